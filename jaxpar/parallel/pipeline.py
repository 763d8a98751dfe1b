"""A pipeline over the mesh axis `pipe`: its counts, the order its layers are stored in, and its schedule.

`Pipeline` (the plan holds one when pipe > 1) names p stages, v repeats (chunks per stage), m microbatches and L
layers, and the schedule. Two executors run it, each in a file of its own:

    circular.py   schedule 'circular' (GPipe is its one-repeat case): one loop over v·m + p − 1 iterations,
                  differentiated by autodiff
    executor.py   every table of `jaxpar.parallel.schedule` (1F1B, interleaved, ZB-H1, ZB-V, GPipe's table): the
                  forward, backward and weight-gradient work items in the table's order, with explicit vjps

Layer order: the stacked layer axis is kept *stage-major* in memory — position (s·v + r)·k + i holds layer c·k + i
of chunk c, the r-th chunk of stage s (k = L/(p·v); c = r·p + s round-robin, or the table's placement, e.g. ZB-V's
V) — so an even split of the axis over `pipe` hands each stage exactly its chunks' layers.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpar.parallel import schedule as tables  # (the table module; `circular.schedule` is the circular loop's grid)
from jaxpar.parallel.schedule import Program




def iterations(stages: int, repeats: int, microbatches: int) -> int:
    """Loop iterations of the circular schedule: v·m to push every microbatch through v passes, p − 1 to fill."""
    return repeats * microbatches + stages - 1


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
    """Idle share of a stage's iterations: (p − 1) / (v·m + p − 1)."""
    return (stages - 1) / iterations(stages, repeats, microbatches)


def pipeline_order(layers: int, stages: int, repeats: int, placement: tuple[int, ...] | None = None) -> np.ndarray:
    """order[n] = the model layer stored at position n of the stacked axis (stage-major: n = (s·v + r)·k + i holds
    layer c·k + i of chunk c, the r-th chunk of stage s — c = r·p + s round-robin, or as `placement` says)."""
    k = layers // (stages * repeats)
    if placement is None:
        placement = tables.placement("circular", stages, repeats)
    chunks = [[c for c in range(stages * repeats) if placement[c] == s] for s in range(stages)]
    return np.array([chunks[s][r] * k + i for s in range(stages) for r in range(repeats) for i in range(k)])


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The circular pipeline's counts: p stages, v repeats, m microbatches, L layers (the plan holds one when
    pipe > 1; `circular` and the step read them)."""

    stages: int
    repeats: int
    microbatches: int
    layers: int
    schedule: str = "circular"  # 'circular': autodiff of `circular`; any other: a table run by `execute`
    skip_bubble: bool = False  # the circular loop's bubble iterations skip the layers (`circular`)

    def __post_init__(self):
        if self.layers % (self.stages * self.repeats):  # the config says so too; a Pipeline built by hand must not
            raise ValueError(f"{self.layers} layers do not split into {self.stages} stages x {self.repeats} chunks")

    @property
    def layer_order(self) -> np.ndarray:
        """order[n] = the model layer at position n of the stacked axis in memory (`pipeline_order`)."""
        return self.stack_order(self.layers)

    def stack_order(self, n: int) -> np.ndarray:
        """`layer_order` for a stack of n of the layers (a mixed dense / MoE model keeps one stack per kind): every
        chunk holds the same kinds of layers (the config checks it), so chunk c holds the c-th n/(p·v) of the stack
        and its storage order is the same rule over n."""
        return pipeline_order(n, self.stages, self.repeats,
                              tables.placement(self.schedule, self.stages, self.repeats))

    @property
    def program(self):
        """The schedule's table lowered for `execute` (built once per shape)."""
        return _program(self.schedule, self.stages, self.repeats, self.microbatches)

    @property
    def iterations(self) -> int:
        return iterations(self.stages, self.repeats, self.microbatches)


@functools.lru_cache(maxsize=64)
def _program(name: str, stages: int, repeats: int, microbatches: int) -> Program:
    return tables.lower(tables.build(name, stages, repeats, microbatches))
