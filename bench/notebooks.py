"""Benchmark: each notebook's wall time, executed top to bottom as tests/test_notebooks.py runs it.

    python -m bench.notebooks [NAME ...]      (default: every notebooks/NN_*.py)

The notebooks are meant to run on a laptop CPU in about two minutes or less each (README, "Notebooks"); this prints
the time and flags any over 120 s — a figure, never a test assertion. Each notebook runs in its own kernel with 8
simulated CPU devices (the notebooks set the device count themselves).
"""

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOAL_S = 120.0


def main(argv: list[str] | None = None) -> int:
    import jupytext
    import nbclient

    parser = argparse.ArgumentParser(prog="python -m bench.notebooks", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="notebook stems, e.g. 01_quickstart (default: all)")
    args = parser.parse_args(argv)
    sources = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    if args.names:
        sources = [s for s in sources if s.stem in args.names]
    if not sources:
        parser.error(f"no notebook named {' '.join(args.names)} under {ROOT / 'notebooks'}")
    width = max(len(s.stem) for s in sources)
    total = 0.0
    for source in sources:
        start = time.perf_counter()
        nbclient.NotebookClient(jupytext.read(source), timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
        seconds = time.perf_counter() - start
        total += seconds
        flag = "" if seconds <= GOAL_S else f"  over the {GOAL_S:.0f} s goal"
        print(f"{source.stem:<{width}}  {seconds:6.1f} s{flag}", flush=True)
    print(f"{'total':<{width}}  {total:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
