"""Building a `Config` from files, dicts and overrides: an ml_collections file (`configs/*.py` with `get_config()`),
a YAML recipe (`recipes/*.yaml`, optionally naming a `base:` file), and `a.b=v` overrides, always through
`config_from_dict`, so every source gets the same checks."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import typing
from typing import Any

import yaml

from jaxpar.config.checks import (reject_unknown, type_hints)
from jaxpar.config.schema import NESTED, PLANNED, SECTIONS, Config
from jaxpar.errors import ConfigError

def config_from_dict(d: dict) -> Config:
    """Nested dict → validated `Config`. Unknown keys get a did-you-mean; types are checked strictly."""
    if not isinstance(d, dict):
        raise ConfigError("config", type(d).__name__, "must be a mapping of sections", "write sections like model: {...}")
    reject_unknown(d, SECTIONS, prefix="")
    sections = {}
    for name in sorted(SECTIONS, key=lambda n: n not in NESTED):  # moe, lora first: the model config holds them
        cls, raw = SECTIONS[name], d.get(name, {}) or {}
        if not isinstance(raw, dict):
            raise ConfigError(name, raw, "must be a mapping of fields", f"write {name}: {{field: value}}")
        names = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("section")}
        reject_unknown(raw, names, prefix=f"{name}.")
        if name == "model":  # the moe and lora sections, already built, ride inside the model config
            raw = dict(raw, **{k: sections.pop(k) for k in NESTED})
        if name == "parallel" and raw.get("auto") is True:  # what the user set stays: the planner keeps it
            train = d.get("train") if isinstance(d.get("train"), dict) else {}
            named = [k for k in raw if k in PLANNED] + (["grad_accum"] if "grad_accum" in train else [])
            raw = dict(raw, keep=tuple(dict.fromkeys([*(raw.get("keep") or ()), *named])))
        sections[name] = cls(**raw)
    return Config(**sections)


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (),
                config_roots: typing.Sequence[str | pathlib.Path] = ()) -> Config:
    """Load a `.py` (ml_collections `get_config()`) or `.yaml` config, apply `a.b=v` overrides, validate.

    A YAML recipe may name `base: path/to/config.py` (relative to the YAML file, or the working directory); its own
    keys then override the base's. A base is code (a `.py` base runs), so it must lie inside the recipe's tree —
    the project that holds the top-level recipe (its nearest ancestor with `.git` or `pyproject.toml`, else the
    recipe's own directory) — or inside one of `config_roots` given explicitly (`jaxpar train --config-root DIR`).
    """
    allowed = tuple(pathlib.Path(r).resolve() for r in config_roots)
    d = _load_file(path, allowed=allowed + (_tree_of(pathlib.Path(path)),)) if path else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(item, None, "an override must look like section.field=value", f"write {item}=VALUE")
        _apply_override(d, key.strip().removeprefix("config."), raw.strip())
    return config_from_dict(d)


def _tree_of(recipe: pathlib.Path) -> pathlib.Path:
    """The directory a recipe's `base:` may reach into: its project (nearest ancestor with .git or pyproject.toml),
    else the recipe's own directory."""
    for parent in recipe.resolve().parents:
        if (parent / ".git").exists() or (parent / "pyproject.toml").is_file():
            return parent
    return recipe.resolve().parent


# What a YAML recipe may expand to, its aliases followed (a recipe is a few dozen nodes): an alias bomb ("billion
# laughs": each level a list of aliases to the one before) is a few lines that expand to 10^9 nodes.
MAX_YAML_NODES = 100_000


class _YamlTooLarge(Exception):
    """A YAML document that expands past MAX_YAML_NODES, or refers to itself (its message says which)."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.2 does; PyYAML's 1.1 rules want `1.0e-3`), and refuses a
    document whose aliases expand it past MAX_YAML_NODES nodes or into itself, before constructing anything."""

    def construct_document(self, node):
        _expanded_size(node)
        return super().construct_document(node)


def _expanded_size(root) -> int:
    """Nodes of a composed YAML document with every alias expanded, counted once per distinct node (an alias is the
    node it names), without recursion; `_YamlTooLarge` past MAX_YAML_NODES or on a node that contains itself."""
    children = lambda n: ([x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode)  # noqa: E731
                          else list(n.value) if isinstance(n, yaml.SequenceNode) else [])
    sizes: dict[int, int] = {}
    path: set[int] = set()  # the nodes being expanded (the current one's ancestors)
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise _YamlTooLarge(f"expands to more than {MAX_YAML_NODES:,} values once its aliases are followed "
                                    "(an alias bomb, or no config)")
            continue
        if key in sizes:
            continue
        if key in path:
            raise _YamlTooLarge(f"holds an alias inside the node it names (line {node.start_mark.line + 1}): it "
                                "would expand forever")
        path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in sizes)
    return sizes[id(root)]


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    __import__("re").compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789."))


def _load_file(path: str, seen: frozenset = frozenset(), allowed: tuple[pathlib.Path, ...] = ()) -> dict:
    p = pathlib.Path(path)
    if not p.exists():
        raise ConfigError("--config", path, "file not found", "pass a path to configs/*.py or recipes/*.yaml")
    if not p.is_file():
        raise ConfigError("--config", path, "is not a file", "pass a path to configs/*.py or recipes/*.yaml")
    if p.resolve() in seen:
        raise ConfigError("base", path, "recipes name each other as base in a cycle", "break the cycle of base: keys")
    if p.suffix == ".py":
        d = _run_config_py(p, path)
    elif p.suffix in (".yaml", ".yml"):
        try:
            d = yaml.load(p.read_text(), Loader=_YamlLoader) or {}
        except _YamlTooLarge as e:
            raise ConfigError("--config", path, str(e), "write each value out (a recipe needs no nested "
                              "aliases)") from None
        except RecursionError:
            raise ConfigError("--config", path, "nests its values too deeply to read", "flatten the YAML (a "
                              "recipe's sections are one or two levels deep)") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            raise ConfigError("--config", path, f"is not valid YAML ({where}{getattr(e, 'problem', None) or e})",
                              "fix the YAML syntax") from None
        if not isinstance(d, dict):
            raise ConfigError("--config", path, "must hold a mapping of sections", "write sections like model: {...}")
    else:
        raise ConfigError("--config", path, "unknown config file type", "use a .py (ml_collections) or .yaml file")
    d = {k: ({} if v is None and k in SECTIONS else v) for k, v in d.items()}  # an empty section is just empty
    base = d.pop("base", None)
    if base is None:
        return d
    if not isinstance(base, str) or not base:
        raise ConfigError("base", base, "must be a path to a .py or .yaml config", "write base: ../configs/tiny.py")
    base_path = p.parent / base if (p.parent / base).exists() else pathlib.Path(base)
    if base_path.is_dir():
        raise ConfigError("base", base, f"is a directory ({base_path})", "name a .py or .yaml config file")
    if base_path.exists() and not any(base_path.resolve().is_relative_to(r) for r in allowed):
        raise ConfigError("base", base, f"resolves to {base_path.resolve()}, outside the recipe's tree "
                          f"{allowed[-1]} (a base is code: a .py base runs when loaded)",
                          "move the base inside that tree, or trust its directory explicitly with --config-root DIR")
    return _deep_merge(_load_file(str(base_path), seen | {p.resolve()}, allowed), d)


def _run_config_py(p: pathlib.Path, path: str) -> dict:
    """Run a `.py` config's get_config() and return it as a dict; anything wrong is one ConfigError."""
    try:
        spec = importlib.util.spec_from_file_location(f"jaxpar_config_{p.stem}", p)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            raise ConfigError("--config", path, "defines no get_config()",
                              "define get_config() returning an ml_collections.ConfigDict")
        cfg = module.get_config()
    except ConfigError:
        raise
    except SystemExit as e:  # a config that exits must not pass for a successful run
        raise ConfigError("--config", path, f"called sys.exit({e.code!r}) while loading",
                          "remove the exit; get_config() must return a ConfigDict") from None
    except Exception as e:  # a broken config file is a config error, reported in one line
        raise ConfigError("--config", path, f"failed to load: {type(e).__name__}: {e}",
                          "fix the file (it must define get_config() returning a ConfigDict)") from None
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, dict):
        raise ConfigError("--config", path, f"get_config() returned {type(cfg).__name__}, not a mapping of sections",
                          "return an ml_collections.ConfigDict (or a dict) with model/parallel/train/... sections")
    return dict(cfg)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _apply_override(d: dict, key: str, raw: str) -> None:
    """Set d[section][field] from the string `raw`, parsed as the field's declared type."""
    section, _, name = key.partition(".")
    if not key:
        raise ConfigError("--config.", raw, "an override needs a key", "write e.g. --config.model.d_model=64")
    if not section or not name:
        raise ConfigError(key or "(empty)", raw, "an override must name section.field", "write e.g. model.d_model=64")
    reject_unknown({section: raw}, SECTIONS, prefix="")
    cls = SECTIONS[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown({name: raw}, fields, prefix=f"{section}.")
    kind = type_hints(cls)[name]
    if not isinstance(d.get(section), dict):
        d[section] = {}
    d[section][name] = _parse_scalar(key, raw, kind)


def _parse_scalar(key: str, raw: str, kind: type) -> Any:
    if typing.get_origin(kind) is tuple:  # a list: "0,1,2", "[0, 1, 2]" or "" / "[]" for none
        items = [x.strip() for x in raw.strip().strip("[]()").split(",") if x.strip()]
        if typing.get_args(kind)[0] is str:
            return tuple(x.strip("'\"") for x in items)
        try:
            return tuple(int(x) for x in items)
        except ValueError:
            raise ConfigError(key, raw, "must be a comma-separated list of integers",
                              f"write e.g. {key}=0,1") from None
    try:
        if kind is bool:
            lowered = raw.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        word = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise ConfigError(key, raw, f"must be {word}", f"pass {word}") from None
    return raw
