"""`python -m bench [--quick]`: the benchmark suite's one table (see bench/run.py)."""

import sys

from bench.run import main

sys.exit(main())
