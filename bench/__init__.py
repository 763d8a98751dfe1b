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


def step_medians(configs: dict, steps: int, rounds: int) -> dict:
    """{key: median seconds a train step} for {key: Config} on all devices: each config's trainer is built, compiled
    and warmed up on a random batch, then `rounds` rounds of `steps` steps run interleaved (every config once a
    round, so a slow spell of the machine hits all of them alike)."""
    import statistics
    import time

    import jax

    from jaxpar.train import build_trainer

    runs = {}
    for key, config in configs.items():
        trainer = build_trainer(config, jax.devices())
        batch = trainer.random_batch(config)
        state, metrics = trainer.train_step(trainer.state, batch)  # compile and warm up
        jax.block_until_ready(metrics)
        runs[key] = [trainer, batch, state, []]
    for _ in range(rounds):
        for run in runs.values():
            trainer, batch, state, times = run
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - start) / steps)
            run[2] = state
    return {key: statistics.median(run[3]) for key, run in runs.items()}
