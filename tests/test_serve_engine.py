"""The continuous-batching engine (`jaxpar.serve.Engine`) on a tiny random model: batch invariance over a workload
of mixed-length requests that arrive at different steps (every request's tokens equal its tokens run alone, and
greedy decoding's), prefix caching (hits counted, the same tokens as misses, LRU eviction under a small pool), static
batching giving the same tokens, seeded sampling, stop tokens and strings, pages released, back-pressure and the
typed errors of bad requests."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.errors import Overloaded, RequestError
from jaxpar.infer import decode
from jaxpar.model import Transformer
from jaxpar.serve import Engine, EngineConfig, SamplingParams

CFG = ModelConfig(vocab_size=263, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=40,
                  max_seq_len=64, init_std=0.2)
SMALL = EngineConfig(max_batch=4, page_size=4, prefill_chunk=8, prefill_rows=2)
RNG = np.random.default_rng(7)
SHARED = RNG.integers(1, 263, 13).tolist()  # a prefix three prompts share (3 full pages of 4)
# (prompt, max_tokens, the step it arrives at): lengths 3 … 30, outputs 4 … 12, arrivals at steps 0, 3 and 6
WORKLOAD = [(RNG.integers(1, 263, 3).tolist(), 9, 0), (RNG.integers(1, 263, 17).tolist(), 5, 0),
            (SHARED + [5, 6], 12, 0), (RNG.integers(1, 263, 25).tolist(), 4, 3), (SHARED + [9], 10, 3),
            (RNG.integers(1, 263, 12).tolist(), 7, 6), (SHARED + RNG.integers(1, 263, 17).tolist(), 6, 6)]


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def run_workload(engine, workload, params=lambda i, n: SamplingParams(max_tokens=n)):
    """Submit each request at its step, step until all finish → each request's tokens, in order."""
    requests, step = [None] * len(workload), 0
    while step == 0 or engine.has_work or None in requests:
        for i, (prompt, n, at) in enumerate(workload):
            if at == step:
                requests[i] = engine.submit(prompt, params(i, n))
        engine.step()
        step += 1
    assert all(r.finished for r in requests)
    return [r.tokens for r in requests]


@pytest.fixture(scope="module")
def alone(model):
    """Each request of the workload alone in the engine (one after another, no prefix caching), its prompt's chunks
    of 8 one a call (one prefill row; the engines under test split a prompt over two rows of one call)."""
    engine = Engine(model, EngineConfig(**{**SMALL.__dict__, "prefix_caching": False, "prefill_rows": 1}))
    return [engine.generate([prompt], SamplingParams(max_tokens=n))[0] for prompt, n, _ in WORKLOAD]


def test_batch_invariance_and_greedy_parity(model, alone):
    """Among the others — joining at steps 0, 3, 6, prefilled in a budget of two chunks of 8 a call (a prompt's
    next two chunks side by side, or the end of one and the start of the next), decoded in whichever
    of the 4 rows is free, three of them reading a shared prefix from the cache — every request's greedy tokens are
    its tokens alone, and `decode.generate`'s."""
    engine = Engine(model, SMALL)
    mixed = run_workload(engine, WORKLOAD)
    assert mixed == alone
    for (prompt, n, _), got in zip(WORKLOAD, mixed):
        want = decode.generate(model, [prompt], max_new_tokens=n, return_prompt=False)[0]
        np.testing.assert_array_equal(got, want)
    assert engine.pool.hits >= 2 * 3  # the later SHARED prompts start after its 3 cached pages
    assert engine.pool.used == 0 and engine.reserved == 0  # every page released (the cached ones evictable)


def test_prefix_cache_hits_and_lru_eviction_give_the_same_tokens(model, alone):
    """A pool of 12 pages (3 rows' worth) for the whole workload, run twice: the cache is hit, pages are evicted
    and reused, and the tokens stay the workload's."""
    engine = Engine(model, EngineConfig(**{**SMALL.__dict__, "n_pages": 13, "max_batch": 3}))
    for _ in range(2):
        assert run_workload(engine, WORKLOAD) == alone
    assert engine.pool.hits > 0 and len(engine.pool.evictable) <= 12


def test_static_batching_gives_the_same_tokens(model, alone):
    engine = Engine(model, EngineConfig(**{**SMALL.__dict__, "static": True}))
    assert run_workload(engine, WORKLOAD) == alone


def test_seeded_sampling_is_per_request(model):
    """A sampled request (temperature, top-k, top-p, its seed) draws the same tokens alone as among the
    workload's; another seed draws others."""
    p = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=11)
    engine = Engine(model, SMALL)
    alone = engine.generate([WORKLOAD[1][0]], p)[0]
    mixed = run_workload(engine, WORKLOAD, lambda i, n: p if i == 1 else SamplingParams(max_tokens=n))
    assert mixed[1] == alone
    assert engine.generate([WORKLOAD[1][0]], SamplingParams(**{**p.__dict__, "seed": 12}))[0] != alone


def test_stop_tokens_strings_and_abort_release_pages(model, alone):
    prompt, n, _ = WORKLOAD[2]
    want = alone[2]
    engine = Engine(model, SMALL, eos_token_id=[want[3]], detokenize=lambda ids: " ".join(map(str, ids)))
    r = engine.submit(prompt, SamplingParams(max_tokens=n))
    while not r.finished:
        engine.step()
    assert r.tokens == want[:4] and r.finish_reason == "stop"  # the eos token ends it (and is the last)
    assert want[0] != want[1]
    r = engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True, stop=(f" {want[1]} ",)))
    while not r.finished:
        engine.step()
    assert r.tokens == want[:3] and r.finish_reason == "stop"  # the stop string complete once token 3 follows it
    assert r.text == str(want[0])  # the output cut before it
    r = engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.pool.used > 0
    engine.abort(r)
    assert r.finish_reason == "abort" and engine.pool.used == 0 and engine.reserved == 0 and not engine.has_work


def test_bad_requests_and_back_pressure(model):
    engine = Engine(model, EngineConfig(**{**SMALL.__dict__, "max_queue": 2}))
    cases = [(lambda: engine.submit([], SamplingParams()), 400),
             (lambda: engine.submit([263], SamplingParams()), 400),
             (lambda: engine.submit([1] * 64, SamplingParams()), 413),
             (lambda: engine.submit([1] * 60, SamplingParams(max_tokens=5)), 400),
             (lambda: SamplingParams(max_tokens=-1), 422), (lambda: SamplingParams(temperature=-1.0), 422),
             (lambda: SamplingParams(top_p=0.0), 422), (lambda: SamplingParams(top_k=-2), 422)]
    for build, status in cases:
        with pytest.raises(RequestError) as err:
            build()
        assert err.value.status == status and "\n" not in str(err.value)
    engine.submit([1, 2], SamplingParams())
    engine.submit([1, 2], SamplingParams())
    with pytest.raises(Overloaded):
        engine.submit([1, 2], SamplingParams())
    engine.step()  # both admitted: the queue has room again
    engine.submit([1, 2], SamplingParams())


def test_tensor_parallel_gives_the_same_tokens(model, alone):
    """The parameters split over tensor 2 and 4 (GSPMD partitions the engine's programs): the same tokens."""
    from _parity import lay_out
    from jaxpar.config import ParallelConfig
    from jaxpar.plan import make_plan

    for t in (2, 4):
        plan = make_plan(CFG, ParallelConfig(tensor=t), jax.devices()[:t], explicit=False)
        placed = nnx.merge(*lay_out(CFG, nnx.state(model), plan))  # the vocab padded to a multiple of t
        with jax.set_mesh(plan.mesh):
            assert run_workload(Engine(placed, SMALL), WORKLOAD) == alone, t


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_models_serve_as_they_generate(quantize):
    """A model loaded with int8 / int4 weights (the llama HF fixture): the engine's greedy tokens equal
    `generate`'s on the same quantized model, for prompts of three lengths side by side."""
    import pathlib

    from jaxpar.infer.text import load

    loaded = load(pathlib.Path(__file__).parent / "fixtures" / "hf" / "llama", quantize=quantize, explicit=False)
    prompts = [[5, 9, 200, 17], [1, 2, 3, 250, 17, 17, 4, 8, 19, 100, 7], [42]]
    engine = Engine(loaded.model, SMALL)
    got = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    want = decode.generate(loaded.model, prompts, max_new_tokens=8, return_prompt=False, mesh=loaded.mesh)
    assert got == np.asarray(want).tolist()


@pytest.mark.parametrize("tensor", [2, 4])
def test_explicit_tensor_parallel_gives_the_same_tokens(tensor, alone):
    """The engine inside an explicit plan's shard_map (each tensor rank its heads' share of every page, its vocab
    shard's logits): the workload's tokens equal tensor 1's."""
    from _parity import lay_out
    from jaxpar.config import ParallelConfig
    from jaxpar.plan import make_plan

    model = Transformer(CFG, rngs=nnx.Rngs(0))
    plan = make_plan(CFG, ParallelConfig(tensor=tensor), jax.devices()[:tensor])
    placed = nnx.merge(*lay_out(CFG, nnx.state(model), plan))
    with jax.set_mesh(plan.mesh):
        assert run_workload(Engine(placed, SMALL, plan=plan), WORKLOAD) == alone


@pytest.mark.parametrize("name,tensor", [("qwen3", 2), ("qwen3_moe", 1), ("gemma3", 2), ("gpt_oss", 2)])
def test_served_hf_models_give_transformers_greedy_tokens(name, tensor):
    """Transformers-written Qwen3 (the q/k norm, a window of 8 shorter than the texts), Qwen3-MoE, Gemma 3 (full
    layers among windowed ones, each kind its RoPE: the paged cache's masks per layer) and gpt-oss (sinks, biases,
    the clamped experts) fixtures served by the engine — all but Qwen3-MoE explicitly over tensor 2 — give
    transformers' 32 greedy tokens for both prompts."""
    import json
    import pathlib

    from jaxpar.infer.text import load

    fixture = pathlib.Path(__file__).parent / "fixtures" / "hf" / name
    cases = json.loads((fixture / "reference.json").read_text())["greedy"]
    loaded = load(fixture, tensor=tensor)
    engine = Engine(loaded.model, SMALL, plan=loaded.plan if tensor > 1 else None)
    with jax.set_mesh(loaded.mesh):
        got = engine.generate([c["prompt"] for c in cases], SamplingParams(max_tokens=32, ignore_eos=True))
    assert got == [c["new_tokens"] for c in cases]
