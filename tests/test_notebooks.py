"""Every notebook runs top to bottom, and its .ipynb is the clean twin of its jupytext .py (the source of truth)."""

import pathlib

import jupytext  # dev dependencies (pyproject's [dev]): a missing one fails here instead of skipping every notebook
import nbclient
import pytest

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
def test_notebook_executes(source):
    """Top to bottom without an error (a failing cell raises CellExecutionError naming it). How long each takes is
    a benchmark: `python -m bench.notebooks`."""
    nbclient.NotebookClient(jupytext.read(source), timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()


def test_there_are_notebooks():
    assert SOURCES, ROOT / "notebooks"  # a moved folder or renamed files would otherwise leave nothing to run
