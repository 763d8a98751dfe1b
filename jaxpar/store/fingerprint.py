"""Checksums of arrays that do not depend on how the arrays are sharded: what checkpoints store to detect bit rot.

A checkpoint's bytes can change after they were written (a flipped bit on disk, a truncated copy, a bad network
filesystem) in ways that still decode: orbax then restores wrong numbers without a word. So every saved array gets
a 64-bit fingerprint at save time, computed from the exact values being written, and the restored array's
fingerprint must match it.

The fingerprint has to be computable on the device, on sharded arrays, without gathering them, and it has to be
the same whatever the layout (a checkpoint written at tensor = 4 is restored at tensor = 1). Both follow from
making it a *sum of integers modulo 2³²*: integer addition is associative and commutative, so every reduction
order and every sharding gives the same bits. For element i of the flattened array, with raw bits v_i (a float's
bit pattern, widened to uint32):

    fp_s = Σ_i  mix(v_i · φ + mix(i + s))   mod 2³²        for two seeds s (64 bits in all)

`mix` is MurmurHash3's 32-bit finaliser, a bijection, and v ↦ v·φ + c (φ odd) is a bijection too, so changing any
single element always changes every term it enters — one corrupted element is detected with certainty, and many
corrupted elements escape only by a ~2⁻⁶⁴ coincidence. Mixing in the index i makes swapped or shifted data
detectable as well. The cost is one elementwise pass and one integer all-reduce per array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SEEDS = (0x243F6A88, 0x85A308D3)  # the first digits of π: arbitrary, fixed forever (stored checksums use them)
_PHI = 0x9E3779B1  # 2³² / golden ratio, odd


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3 fmix32 on uint32 (wraps mod 2³²)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
    """The raw bits of every element as uint32, same shape as x."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.integer) and jnp.iinfo(x.dtype).bits < 8:  # int4: its bits, from its value
        return (x.astype(jnp.int32) & ((1 << jnp.iinfo(x.dtype).bits) - 1)).astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
    if size == 8:  # two words per element, [..., 2]: fold them so the high word cannot cancel the low one
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return words[..., 0] ^ _mix(words[..., 1] + jnp.uint32(_PHI))
    raise TypeError(f"cannot fingerprint dtype {x.dtype}")


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Row-major element index as uint32 (mod 2³², which is all the hash needs), built from per-axis iotas so it
    shards like the array instead of materialising one long range."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _fingerprint(x: jax.Array) -> jax.Array:
    """uint32 [2]: the two seeded sums for one array."""
    v = _bits(x) * jnp.uint32(_PHI)
    i = _flat_index(x.shape)
    return jnp.stack([jnp.sum(_mix(v + _mix(i + jnp.uint32(s))), dtype=jnp.uint32) for s in _SEEDS])


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_fingerprint(x) for x in leaves]


def leaf_path(path) -> str:
    """A pytree key path as 'a/0/mu/b' (dict keys, sequence indices and attribute names alike)."""
    return "/".join(_key(k) for k in path)


def fingerprints(tree) -> dict[str, str]:
    """{"a/b/c": 16 hex digits} for every array leaf of the pytree `tree` (paths as `leaf_path` writes them).

    Runs as one jitted program over the (possibly sharded, possibly multi-process) arrays; every process gets the
    same result. Scalars and NumPy arrays are fingerprinted too.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    paths = [leaf_path(path) for path, _ in flat]
    sums = jax.device_get(_fingerprints([jnp.asarray(x) for _, x in flat]))
    return {p: f"{int(s[0]):08x}{int(s[1]):08x}" for p, s in zip(paths, np.asarray(sums).reshape(-1, 2))}


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


__all__ = ["fingerprints", "leaf_path"]
