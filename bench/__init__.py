"""jaxpar's benchmarks: `python -m bench` runs the suite (bench/run.py); the other scripts run one study each."""


def with_devices(module: str, devices: int, argv: list[str] | None) -> None:
    """Re-run `python -m module` with `devices` simulated CPU devices unless this process already has them (the
    device count is fixed when jax starts, so a benchmark that needs 8 devices re-executes itself with the flag)."""
    import os
    import sys

    flag = f"--xla_force_host_platform_device_count={devices}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(), JAX_PLATFORMS="cpu")
        os.execve(sys.executable, [sys.executable, "-m", module, *(argv if argv is not None else sys.argv[1:])], env)
