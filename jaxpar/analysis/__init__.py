"""Compiled-program accounting: collectives by kind, mesh axis and bytes; dot FLOPs with loop trip counts; memory."""

from jaxpar.analysis.hlo import (
    Collective,
    HloProgram,
    collective_summary,
    collectives,
    cost,
    dot_flops,
    loop_trip_counts,
    memory,
    parse_hlo,
    replica_group_axes,
    summary_key,
)

__all__ = [
    "Collective",
    "HloProgram",
    "collective_summary",
    "collectives",
    "cost",
    "dot_flops",
    "loop_trip_counts",
    "memory",
    "parse_hlo",
    "replica_group_axes",
    "summary_key",
]
