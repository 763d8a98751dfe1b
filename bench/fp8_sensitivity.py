"""How sensitive FP8 training gradients are to fp32-level noise, and where each layout's FP8 run falls (issue 42).

    PYTHONPATH=. python bench/fp8_sensitivity.py        (8 simulated CPU devices; ~2 minutes on 2 cores)

The models and batch of tests/test_fp8.py (model.matmul = fp8_rowwise, dense and MoE). For each:
  1. on ONE device, the parameters moved by 1e-7 relative (4 seeds): the loss's relative change, and the distance of
     the gradients to the unmoved run's over the FP8-vs-float gradient distance — how far fp32 reassociation noise
     alone can move an FP8 gradient (a value crossing an e5m2 step, a router near-tie);
  2. each layout of tests/test_fp8.py: the same two figures against the single-device FP8 run (the test asserts
     loss within 1e-3 and the distance ratio under 0.5).
Prints one line per run; the figures quoted in the README and in tests/test_fp8.py come from this script.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from _parity import _flat, on_layout  # noqa: E402
from jaxpar.config import ParallelConfig  # noqa: E402
from jaxpar.model import Transformer  # noqa: E402
from jaxpar.plan import make_plan  # noqa: E402
from jaxpar.train.step import loss_and_grads, whole  # noqa: E402
from test_fp8 import LAYOUTS, reference  # noqa: E402


def distance(a, b) -> float:
    fa, fb = _flat(a), _flat(b)
    return float(np.sqrt(sum(((fa[k] - fb[k]) ** 2).sum() for k in fa)))


def main() -> None:
    for kind in ("dense", "moe"):
        cfg, params, batch, loss, grads, _ = reference(kind)
        graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))
        plain = nnx.graphdef(Transformer(dataclasses.replace(cfg, matmul="float"), rngs=nnx.Rngs(0)))
        scale = distance(grads, jax.jit(loss_and_grads(plain))(params, batch)[1])  # FP8 vs float
        fn = jax.jit(loss_and_grads(graphdef, par=whole(make_plan(cfg))))
        for seed in range(4):
            keys = iter(jax.random.split(jax.random.key(seed), 1000))
            moved = jax.tree.map(lambda p: p * (1 + 1e-7 * jax.random.normal(next(keys), p.shape)), params)
            l2, g2 = fn(moved, batch)
            print(f"{kind}, one device, params x (1 + 1e-7 noise) seed {seed}: "
                  f"loss {float(l2) / float(loss) - 1:+.1e}, gradients {distance(g2, grads) / scale:.2g} of the FP8-vs-float distance", flush=True)
        for name, (parallel, accumulate, model_kind) in LAYOUTS.items():
            if model_kind != kind:
                continue
            l2, g2 = on_layout(cfg, params, batch, ParallelConfig(**parallel), grad_accum=accumulate)
            print(f"{kind}, {name}: loss {float(l2) / float(loss) - 1:+.1e}, gradients "
                  f"{distance(g2, grads) / scale:.2g} of the FP8-vs-float distance", flush=True)


if __name__ == "__main__":
    main()
