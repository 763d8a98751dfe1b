"""The attention kind is the one place a cache layout is declared (jaxpar.families.attention): a new kind — here a
test-only one that keeps each slot's keys and values in one array [L, B, S, 2, K, E + 1], one spare column a head
(as an aligned layout pads), so its bytes are not GQA's — arrives as a table entry and its layer function, and
decoding (single device, GSPMD and explicit tensor parallelism, with the kv heads split and replicated), the
planner's cache bytes and the layout checks take it as they are."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import lay_out
from jaxpar import families, model as model_lib
from jaxpar.config import ConfigError, ModelConfig, ParallelConfig, check_layout
from jaxpar.families.attention import ATTENTION_KINDS, GQA
from jaxpar.families.base import CacheArray
from jaxpar.infer import decode
from jaxpar.model import KVCache, Transformer
from jaxpar.plan import make_plan
from jaxpar.planner.memory import kv_cache_bytes

# Prime vocab, 2 kv heads (split at tensor 2, replicated at tensor 4), odd widths.
CFG = ModelConfig(vocab_size=263, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=40,
                  max_seq_len=64, init_std=0.2)
PROMPTS = [[5, 9, 200, 7, 31], [1, 2, 3], [250, 17, 17, 4, 99, 61, 8, 3, 12], [42]]
TRACED = []  # the arrays each trace of the fused store saw (the test's proof that decoding ran the new kind)


def _fused_cache(cfg, tensor: int) -> dict[str, CacheArray]:
    (k,) = [a for name, a in GQA.cache(cfg, tensor).items() if name == "k"]
    K, E = k.shape
    return {"kv": CacheArray((2, K, E + 1), (None, *k.axes), split=1)}  # one slot: [2, K_local, E + 1]


def fused_attention(p, h, positions, mask, cfg, par=model_lib.SINGLE_DEVICE, kv_cache=None):
    """GQA's math with the fused cache: the store it hands GQA stacks k and v into the one array and splits them
    back out of the layer's slots."""
    if kv_cache is None:
        return model_lib.gqa_attention(p, h, positions, mask, cfg, par)

    def store(new):
        TRACED.append(sorted(new))
        kv = jnp.stack([new["k"], new["v"]], axis=2)  # [B, T, 2, K, E]
        cache, layer = kv_cache({"kv": jnp.pad(kv, [(0, 0)] * 4 + [(0, 1)])})  # the spare column: zeros
        return cache, {"k": layer["kv"][:, :, 0, :, :-1], "v": layer["kv"][:, :, 1, :, :-1]}

    return model_lib.gqa_attention(p, h, positions, mask, cfg, par, store)


@pytest.fixture
def fused(monkeypatch):
    """The llama family with the fused-cache kind, registered for this test only → its ModelConfig."""
    kind = dataclasses.replace(GQA, name="fused_kv", cache=_fused_cache)
    monkeypatch.setitem(ATTENTION_KINDS, kind.name, kind)
    monkeypatch.setitem(model_lib.ATTENTION, kind.name, fused_attention)
    monkeypatch.setitem(families.FAMILIES, "llama_fused",
                        dataclasses.replace(families.FAMILIES["llama"], name="llama_fused", attention=kind.name))
    return dataclasses.replace(CFG, family="llama_fused")


def _placed(cfg, tensor: int, data: int):
    parallel = ParallelConfig(data=data, tensor=tensor)
    plan = make_plan(cfg, parallel, jax.devices()[:data * tensor])
    return nnx.merge(*lay_out(cfg, nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param), plan)), plan


def test_a_new_cache_layout_decodes_as_gqa_does(fused):
    """Greedy tokens of the fused-cache model equal the GQA model's (the same weights: same seed, same parameters)
    on one device, under GSPMD on a (data 2, tensor 2) mesh, and on explicit plans at tensor 2 and 4 — and its cache
    is the declared one array."""
    gqa_model, fused_model = Transformer(CFG, rngs=nnx.Rngs(0)), Transformer(fused, rngs=nnx.Rngs(0))
    want = decode.generate(gqa_model, PROMPTS, max_new_tokens=6)
    TRACED.clear()
    np.testing.assert_array_equal(decode.generate(fused_model, PROMPTS, max_new_tokens=6), want)
    assert TRACED and all(names == ["k", "v"] for names in TRACED)
    cache = KVCache.empty(fused, 4, 16)
    assert {k: v.shape for k, v in cache.arrays.items()} == {"kv": (3, 4, 16, 2, 2, 7)}

    for tensor in (2, 4):
        model, plan = _placed(fused, tensor, data=2)
        np.testing.assert_array_equal(decode.generate(model, PROMPTS, max_new_tokens=6, plan=plan), want)
        if tensor == 2:  # the same placed weights, partitioned by GSPMD
            np.testing.assert_array_equal(decode.generate(model, PROMPTS, max_new_tokens=6, mesh=plan.mesh), want)


def test_the_planner_and_the_checks_read_the_kind(fused, monkeypatch):
    """The planner's cache bytes are the explicit decode step's cache array, byte for byte, at (data, tensor) =
    (1, 1), (2, 2) and (2, 4) — (E + 1)/E of GQA's; the layout check is the kind's: a kind that refuses a tensor
    degree is refused there, and GQA's rules still hold for it otherwise."""
    batch, slots = 6, 13
    E = CFG.head_dim
    for data, tensor in ((1, 1), (2, 2), (2, 4)):
        model, plan = _placed(fused, tensor, data)
        _, args = decode.explicit_decode_step(model, plan, batch=batch, slots=slots, temperature=0.0, top_k=0,
                                              top_p=1.0)
        (array,) = args[2].values()
        want = kv_cache_bytes(fused, batch, slots, data, tensor)
        assert array.addressable_shards[0].data.nbytes == want
        assert want * E == kv_cache_bytes(CFG, batch, slots, data, tensor) * (E + 1)
    with pytest.raises(ConfigError, match="model.n_kv_heads"):
        check_layout(dataclasses.replace(fused, n_heads=6, n_kv_heads=3, head_dim=4), ParallelConfig(tensor=2))

    def refuse(cfg, tensor):
        if tensor > 2:
            raise ConfigError("parallel.tensor", tensor, "the fused test layout splits over at most 2 ranks",
                              "use parallel.tensor 1 or 2")

    monkeypatch.setitem(ATTENTION_KINDS, "fused_kv", dataclasses.replace(ATTENTION_KINDS["fused_kv"], check=refuse))
    check_layout(fused, ParallelConfig(tensor=2))
    with pytest.raises(ConfigError, match="splits over at most 2 ranks"):
        check_layout(fused, ParallelConfig(tensor=4))
