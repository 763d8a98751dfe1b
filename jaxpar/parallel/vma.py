"""Varying-manual-axes typing (`shard_map(check_vma=True)`): one helper the collectives share.

Inside `shard_map` JAX types every value with the set of mesh axes it may differ over ("vma"). An op mixing an
invariant value with a varying one inserts an implicit broadcast whose transpose is a psum, and a `custom_vjp`
must return cotangents typed like its inputs. Our collectives write their gradients out explicitly, so they mark
values varying explicitly with `vary` (no data moves; it only changes the type).
"""

from __future__ import annotations

from typing import Sequence

import jax

# jax >= 0.8 spells it pcast(..., to="varying"); older releases had pvary.
_pcast = getattr(jax.lax, "pcast", None)


def varying_axes(x: jax.Array | jax.ShapeDtypeStruct) -> frozenset[str]:
    """The mesh axes x may differ over (jax 0.12: aval.manual_axis_type.varying; 0.10-0.11: aval.vma); x a value or
    the `jax.eval_shape` of one."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    typed = getattr(aval, "manual_axis_type", None)
    return frozenset(typed.varying if typed is not None else getattr(aval, "vma", ()))


def vary(x: jax.Array, axes: str | Sequence[str]) -> jax.Array:
    """x typed as varying over `axes` (those it already varies over are skipped)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    return _pcast(x, missing, to="varying") if _pcast is not None else jax.lax.pvary(x, missing)


def zeros(like: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `like`'s shape and dtype, typed as varying over the axes it varies over (`like` from jax.eval_shape
    inside shard_map): what a branch of a `lax.cond` that skips work returns in place of the work's result."""
    return vary(jax.numpy.zeros(like.shape, like.dtype), tuple(varying_axes(like)))
