"""The README's config reference is generated from the config classes; this fails when it drifts."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_config_reference_matches_config_classes():
    spec = importlib.util.spec_from_file_location("update_readme", ROOT / "scripts" / "update_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (ROOT / "README.md").read_text()
    assert module.render(text) == text, "README config reference is stale: run `python scripts/update_readme.py`"


def test_every_public_function_and_class_has_a_docstring():
    """Public functions, classes and methods defined in jaxpar (not imported into it) carry a docstring."""
    import importlib
    import inspect
    import pkgutil

    import jaxpar

    missing = []
    for info in pkgutil.walk_packages(jaxpar.__path__, "jaxpar."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if not (obj.__doc__ or "").strip():
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(obj):
                missing += [f"{module.__name__}.{name}.{m}" for m, f in vars(obj).items()
                            if not m.startswith("_") and inspect.isfunction(f) and not (f.__doc__ or "").strip()]
    assert not missing, f"add docstrings to: {', '.join(missing)}"
