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
