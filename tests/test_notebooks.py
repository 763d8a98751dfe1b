"""Every notebook runs top to bottom, and its .ipynb is the clean twin of its jupytext .py (the source of truth)."""

import pathlib
import time

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_is_paired_and_clean(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"run: jupytext --to ipynb {source.relative_to(ROOT)}"
    ipynb = jupytext.read(paired)
    assert _cells(ipynb) == _cells(jupytext.read(source)), f"out of sync: jupytext --sync {source.relative_to(ROOT)}"
    assert not any(c.get("outputs") for c in ipynb.cells if c.cell_type == "code"), "commit notebooks without outputs"


@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_executes_within_two_minutes(source):
    nb = jupytext.read(source)
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    seconds = time.perf_counter() - start
    print(f"{source.name}: {seconds:.1f} s")
    assert seconds <= 120, f"{source.name} took {seconds:.0f} s; notebooks must stay under 2 minutes"
