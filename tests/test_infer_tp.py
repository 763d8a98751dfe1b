"""Explicit tensor-parallel inference (jaxpar.infer.decode with a plan): prefill logits against the single-device
model for every family at tensor 2 and 4, greedy tokens against one device, sampled tokens the same at every tensor
degree (the vocab-parallel sampler), and the tensor-axis bytes of one compiled decode step against Megatron's
count — two all-reduces of b·h a layer, the embedding's one, and the sampler's per-row scalars; nothing of size V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import lay_out
from jaxpar.analysis import collectives
from jaxpar.config import ModelConfig, MoEConfig, ParallelConfig
from jaxpar.infer import decode
from jaxpar.model import KVCache, Transformer
from jaxpar.plan import make_plan

# Prime vocab (padded at every tensor degree), GQA with 2 kv heads (replicated at tensor 4), odd-ish widths.
BASE = dict(vocab_size=263, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=40, max_seq_len=64,
            init_std=0.2)
FAMILIES = {
    "llama": ModelConfig(**BASE),
    "qwen2": ModelConfig(**BASE, qkv_bias=True, sliding_window=5),
    "gpt2": ModelConfig(**dict(BASE, family="gpt2", n_kv_heads=4, tie_embeddings=True)),
    "moe": ModelConfig(**BASE, moe=MoEConfig(n_experts=4, top_k=2, d_ff=8, shared_d_ff=8, shared_gate=True,
                                             dense_layers=(0,))),
}
PROMPTS = [[5, 9, 200, 7, 31], [1, 2, 3], [250, 17, 17, 4, 99, 61, 8, 3, 12], [42]]


def placed(cfg: ModelConfig, tensor: int, data: int = 1, overlap: bool = False):
    """The same random model (seed 0) laid out for (data, tensor) on the first data·tensor devices, and its plan;
    `overlap`: the prefill with sequence parallelism and collective matmuls."""
    parallel = ParallelConfig(data=data, tensor=tensor, sequence_parallel=overlap,
                              overlap="collective_matmul" if overlap else "none")
    plan = make_plan(cfg, parallel, jax.devices()[:data * tensor])
    return nnx.merge(*lay_out(cfg, nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param), plan)), plan


@pytest.mark.parametrize("family", list(FAMILIES))
def test_explicit_prefill_equals_the_single_device_model(family):
    """Prefill logits under the explicit shard_map at tensor 2 and 4 (data 2), and at tensor 4 with sequence
    parallelism and collective matmuls, equal the single-device model's (fp32, max |Δ| ≤ 1e-5) for every family,
    right-padded rows of different lengths included."""
    cfg = FAMILIES[family]
    tokens, lengths = decode.right_pad(PROMPTS)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    cache = KVCache.empty(cfg, tokens.shape[0], tokens.shape[1])
    want = np.asarray(jax.jit(lambda m, t, c: m.decode(t, c)[0])(model, jnp.asarray(tokens), cache))
    real = np.arange(tokens.shape[1])[None, :] < lengths[:, None]  # padding slots' logits are never read
    for tensor, overlap in ((2, False), (4, False), (4, True)):
        got = decode.explicit_prefill_logits(*placed(cfg, tensor, data=2, overlap=overlap), tokens)
        assert np.abs(got - want)[real].max() <= 1e-5, (tensor, overlap, np.abs(got - want)[real].max())


def test_explicit_decoding_greedy_equals_one_device_and_sampling_is_layout_free():
    """Greedy tokens at tensor 2 (data 2) and 4 (data 2, an SP + collective-matmul prefill) equal the
    single-device greedy tokens; sampling with top-k, or top-p (the bisection nucleus) at a temperature, draws the
    same tokens at those layouts as at tensor 1."""
    cfg = FAMILIES["llama"]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    want = decode.generate(model, PROMPTS, max_new_tokens=10)
    settings = [dict(do_sample=True, top_k=7, seed=3), dict(do_sample=True, top_p=0.7, temperature=0.8, seed=4)]
    sampled = {}
    layouts = ((1, 1, False), (2, 2, False), (4, 2, True))
    for layout in layouts:
        m, plan = placed(cfg, *layout)
        if layout[0] > 1:
            np.testing.assert_array_equal(decode.generate(m, PROMPTS, max_new_tokens=10, plan=plan), want)
        sampled[layout] = [decode.generate(m, PROMPTS, max_new_tokens=10, plan=plan, **s) for s in settings]
    for layout in layouts[1:]:
        for a, b in zip(sampled[layout], sampled[layouts[0]]):
            np.testing.assert_array_equal(a, b)
    assert not all((s == want).all() for s in sampled[layouts[0]])  # sampling did sample


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=5),
                                      dict(temperature=1.0, top_p=0.9)], ids=["greedy", "top_k", "top_p"])
def test_decode_step_sends_two_all_reduces_of_bh_a_layer(sampling):
    """One compiled decode step at tensor 4: the tensor-axis collectives are 2L + 1 all-reduces of [b, 1, h]
    (attention out and MLP down per layer, the vocab-parallel embedding) and the sampler's per-row scalars — for
    greedy a pmax and a pmin of [b]; for top-k also the t·k candidates (values and ids) and a pmax; for top-p the
    bisection's 48 all-reduces of [b] masses — and no collective holds more than b·h elements (no O(V) traffic)."""
    cfg = FAMILIES["llama"]
    b, t = 4, 4
    model, plan = placed(cfg, t)
    fn, args = decode.explicit_decode_step(model, plan, batch=b, slots=16, **{"top_k": 0, "top_p": 1.0, **sampling})
    cols = [c for c in collectives(fn.lower(*args).compile(), plan.mesh) if "tensor" in c.axes]
    big = [c for c in cols if c.elements == b * cfg.d_model]
    assert all(c.kind == "all-reduce" for c in big) and sum(c.count for c in big) == 2 * cfg.n_layers + 1
    small = [c for c in cols if c not in big]
    assert max(c.elements for c in cols) == b * cfg.d_model
    if sampling["temperature"] == 0:
        assert sorted((c.kind, c.elements) for c in small) == [("all-reduce", b), ("all-reduce", b)]
    elif "top_p" in sampling:  # the bisection loop's psum of the [b] masses runs 48 times (trip count applied)
        assert ("all-reduce", b, 48) in {(c.kind, c.elements, c.count) for c in small}
        assert all(c.kind == "all-reduce" and c.elements <= 2 * b for c in small)
    else:
        k = sampling["top_k"]
        assert {(c.kind, c.elements) for c in small} == {("all-gather", b * k * t), ("all-reduce", b)}
    sent = sum(c.sent_bytes * c.count for c in big)
    assert sent == (2 * cfg.n_layers + 1) * 2 * (t - 1) / t * b * cfg.d_model * 4


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_cache_bytes_are_the_decode_steps_arrays(family):
    """The planner's inference memory (`memory.inference_bytes`) equals, byte for byte, what one compiled decode step
    holds per device: its cache shards at (data, tensor) = (1, 1), (2, 2) and (2, 4) — at tensor 4 llama's 2 kv heads
    do not split, so each rank keeps one — and the parameter shards, which with the cache are the step's arguments
    but for the token, the rows' lengths and the key (int32 [B/data] ×2, a key: within the 60 bytes allowed here)."""
    from jaxpar.analysis.hlo import memory as compiled_memory
    from jaxpar.planner.memory import inference_bytes

    cfg = FAMILIES[family]
    batch, slots = 6, 13
    for data, tensor in ((1, 1), (2, 2), (2, 4)):
        model, plan = placed(cfg, tensor, data=data)
        fn, args = decode.explicit_decode_step(model, plan, batch=batch, slots=slots, temperature=0.0, top_k=0,
                                               top_p=1.0)
        want = inference_bytes(cfg, batch, slots, data, tensor)
        cache = args[2]  # the cache's arrays: llama and gpt2 attend with GQA, k and v
        assert sum(a.addressable_shards[0].data.nbytes for a in cache.values()) == want["kv_cache"]
        held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(args[0]))
        assert held == want["params"], (data, tensor, held, want["params"])
        small = 2 * 4 * batch // data + 4 + jax.random.key_data(args[-1]).nbytes
        assert 0 <= compiled_memory(fn.lower(*args).compile())["argument_bytes"] - want["total"] <= small


def test_the_explicit_program_cache_is_bounded(monkeypatch):
    """A caller that varies the sampling settings (a server) builds a program per setting; the cache keeps the
    EXPLICIT_CACHE_SIZE most recently used, and a program in use is never rebuilt."""
    import collections

    monkeypatch.setattr(decode, "_EXPLICIT_CACHE", collections.OrderedDict())
    built = []
    n = decode.EXPLICIT_CACHE_SIZE
    for key in range(n + 5):
        decode._program(("settings", key), lambda key=key: built.append(key) or f"program {key}")
        assert decode._program(("settings", 0), lambda: built.append("again")) == "program 0"  # kept hot
    assert len(decode._EXPLICIT_CACHE) == n and ("settings", 0) in decode._EXPLICIT_CACHE
    assert built == list(range(n + 5)) and ("settings", 1) not in decode._EXPLICIT_CACHE  # the oldest unused: gone
