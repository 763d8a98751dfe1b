"""jaxpar's benchmarks: `python -m bench` runs the suite (bench/run.py); the other scripts run one study each."""
