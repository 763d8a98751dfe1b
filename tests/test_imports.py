"""The package graph has no back edges: each module imports only its own layer or lower ones.

Two checks. The static one reads every import statement in jaxpar/ — module level and inside functions, where a
back edge hides best — and holds it to LAYERS. The dynamic one imports a module in a fresh interpreter and looks at
what came along: loading a model for inference must not pull in the training stack, importing the model must not
pull in checkpoints, and so on.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpar"

# Lowest layer first. A name is a module or package under jaxpar/ (a dotted name picks out one module of a package:
# `parallel.axes` is not in `parallel`'s layer). A module may import its own name and any name in a lower layer;
# names that share a layer are siblings and must not import each other.
LAYERS = (
    ("errors",),                                          # the user-error types
    ("parallel.axes", "parallel.schedule", "families",    # mesh-axis names and rules, pipeline schedule tables,
     "matmul", "distributed", "perf", "launch"),          # model families as data (pure data, read by config); the
                                                          # matmul seam; process setup and local launch
    ("config",),                                          # typed config, every check
    ("parallel", "fp8"),                                  # one file per parallelism: f/g, SP, the pipeline; the
                                                          # FP8 matmul policies over the seam
    ("mesh", "sharding"),                                 # devices → mesh; logical axes → specs
    ("model", "flops", "data", "plan"),                   # the transformer; FLOPs of its shape; tokens; the
                                                          # layout planner (it builds meshes and specs)
    ("planner",),                                         # the analytic model of a step (FLOPs, bytes, memory,
                                                          # time) and the search over layouts it ranks
    ("store",),                                           # what a workdir holds: checkpoints, checksums, lock
    ("interop",),                                         # Hugging Face directories ↔ workdirs
    ("infer", "train"),                                   # generation and training: neither needs the other
    ("analysis", "serve"),                                # compiles the training step to account for it; the
                                                          # serving engine and its HTTP server (over infer)
    ("cli",),                                             # thin entry points over all of the above
)
LAYER = {name: n for n, names in enumerate(LAYERS) for name in names}


def _name_of(module: str) -> str:
    """The LAYERS name that `module` ('jaxpar.parallel.tensor') belongs to: the longest one that is it or a package
    holding it ('parallel')."""
    parts = module.split(".")[1:]
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in LAYER:
            return ".".join(parts[:k])
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_imports.py")


def _module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every jaxpar module that `source` (module `module`) imports, anywhere in it, in line order.
    `from jaxpar.p import m` names jaxpar.p.m when m is a module (it may sit in another layer than its package),
    else jaxpar.p."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from ..x import y` resolved against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else base))
    return sorted((line, name) for line, name in found if name.startswith("jaxpar."))


def test_every_import_goes_down_the_layers():
    files = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")
    assert files
    violations = []
    for path in files:
        own = _name_of(_module_of(path))
        for line, target in _imports(path.read_text(), _module_of(path), path.name == "__init__.py"):
            name = _name_of(target)
            if name == own or LAYER[name] < LAYER[own]:
                continue
            relation = "siblings" if LAYER[name] == LAYER[own] else ">"
            violations.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                              f"(layer {LAYER[name]} {name} {relation} {LAYER[own]} {own})")
    assert not violations, "imports against LAYERS:\n" + "\n".join(violations)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm): each holds an import
    cycle."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules():
    """LAYERS lets modules of one name import each other (`planner.search`, `planner.cost`); a cycle between two
    modules, even through an import inside a function, still means neither can be read or changed alone."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        graph[module] = {t for _, t in _imports(path.read_text(), module, path.name == "__init__.py")
                         if t != module and not (path.name == "__init__.py" and t.startswith(module + "."))}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles(graph), "import cycles: " + "; ".join(" <-> ".join(c) for c in _cycles(graph))


def test_the_static_check_sees_every_kind_of_import():
    """What the layer check relies on: dotted names, `from p import m`, relative imports, imports inside functions."""
    source = ("from jaxpar import flops\n"
              "from jaxpar.store import checkpoint\n"
              "import jaxpar.model as m\n"
              "from . import decode\n"
              "from ..store.lock import WorkdirLock\n"
              "def f():\n"
              "    from jaxpar.train import fit\n")
    assert _imports(source, "jaxpar.infer.text") == [
        (1, "jaxpar.flops"), (2, "jaxpar.store.checkpoint"), (3, "jaxpar.model"), (4, "jaxpar.infer.decode"),
        (5, "jaxpar.store.lock"), (7, "jaxpar.train")]
    assert _name_of("jaxpar.parallel.tensor") == "parallel"
    assert _name_of("jaxpar.parallel.axes") == "parallel.axes"
    with pytest.raises(AssertionError, match="in no layer"):
        _name_of("jaxpar.nowhere")


# What importing each module (in a fresh interpreter) must not load: the jaxpar packages it has no use for.
MUST_NOT_LOAD = {
    "jaxpar.config": ("mesh", "sharding", "model", "flops", "data", "store", "interop", "infer", "train", "analysis"),
    "jaxpar.parallel.tensor": ("mesh", "sharding", "model", "data", "store", "interop", "infer", "train", "analysis"),
    "jaxpar.model": ("flops", "data", "store", "interop", "infer", "train", "analysis"),
    "jaxpar.flops": ("model", "data", "store", "interop", "infer", "train", "analysis"),
    "jaxpar.data": ("model", "store", "interop", "infer", "train", "analysis"),
    "jaxpar.store.checkpoint": ("data", "interop", "infer", "train", "analysis"),
    "jaxpar.interop.hf": ("infer", "train", "analysis"),
    "jaxpar.infer": ("data", "store", "interop", "train", "analysis"),
    "jaxpar.infer.text": ("train", "analysis"),
    "jaxpar.train": ("infer", "analysis"),
    "jaxpar.analysis": ("model", "store", "interop", "infer", "train"),  # the HLO parser alone
    "jaxpar.cli": ("model", "store", "interop", "infer", "train", "analysis"),  # config errors print fast
}

# One fresh interpreter for all modules: it imports the third-party libraries once (about a second each time
# otherwise), then forks a child per module, which imports it and reports the jaxpar modules it loaded. No jaxpar
# module is loaded before the fork, so each child starts as clean of jaxpar as a new interpreter.
_PROBE = """
import json, os, sys
for lib in ("numpy", "jax", "jax.numpy", "flax.nnx", "flax.struct", "optax", "orbax.checkpoint", "safetensors",
            "grain", "yaml", "tqdm"):
    try:
        __import__(lib)
    except ImportError:
        pass  # the child imports it itself: slower, the same answer
assert not [m for m in sys.modules if m.split(".")[0] == "jaxpar"]
loaded = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        status = 1
        try:
            __import__(name)
            os.write(w, json.dumps(sorted(m for m in sys.modules if m.startswith("jaxpar."))).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    loaded[name] = json.loads(out) if status == 0 else None
print(json.dumps(loaded))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str] | None]:
    out = subprocess.run([sys.executable, "-c", _PROBE, *MUST_NOT_LOAD], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted(MUST_NOT_LOAD))
def test_importing_a_module_loads_nothing_above_it(loaded, module):
    assert loaded[module] is not None, f"import {module} failed in a fresh interpreter"
    packages = {m.split(".")[1] for m in loaded[module]}
    pulled = sorted(packages & set(MUST_NOT_LOAD[module]))
    assert not pulled, f"import {module} loads jaxpar.{{{', '.join(pulled)}}}: {loaded[module]}"
