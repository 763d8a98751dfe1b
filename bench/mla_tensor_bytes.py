"""Tensor-axis bytes per layer of an MLA (deepseek) training step at tensor 2, with and without sequence parallelism,
from the compiled program (jaxpar.analysis.hlo.collectives) against the analytic count in
jaxpar.model.mla_attention's docstring. Per layer = (bytes at 4 layers − bytes at 2 layers) / 2, so the embedding,
head and loss cancel.

    PYTHONPATH=. python bench/mla_tensor_bytes.py        (8 simulated CPU devices; uses 2)
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.analysis.hlo import collectives  # noqa: E402
from jaxpar.config import Config, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from jaxpar.planner import expected  # noqa: E402
from jaxpar.model import Transformer  # noqa: E402
from jaxpar.plan import make_plan  # noqa: E402
from jaxpar.sharding import param_specs  # noqa: E402
from jaxpar.train.step import sharded_loss_and_grads  # noqa: E402

B, T, t, beta = 2, 64, 2, 4
FIELDS = dict(family="deepseek", vocab_size=256, d_model=64, n_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24, d_ff=96, max_seq_len=T, scan_unroll=1)


def config(n_layers: int, sp: bool, context: int = 1, impl: str = "all_gather") -> Config:
    return Config(model=ModelConfig(**FIELDS, n_layers=n_layers),
                  parallel=ParallelConfig(data=1, pipe=1, tensor=t, sequence_parallel=sp, microbatches=1, repeats=1,
                                          context=context, context_impl=impl),
                  train=TrainConfig(batch_size=B, seq_len=T))


def tensor_bytes(n_layers: int, sp: bool, context: int = 1, impl: str = "all_gather", axis: str = "tensor") -> float:
    cfg = ModelConfig(**FIELDS, n_layers=n_layers)
    plan = make_plan(cfg, config(n_layers, sp, context, impl).parallel, jax.devices()[:t * context])
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), padded_vocab=plan.padded_vocab), nnx.Param)
    specs = param_specs(params, plan.rules, plan.param_zero_data)
    fn = sharded_loss_and_grads(graphdef, plan, param_specs=specs)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    compiled = jax.jit(fn).lower(abstract, jax.ShapeDtypeStruct((B, T + 1), jnp.int32)).compile()
    return sum(c.sent_bytes * c.count for c in collectives(compiled, plan.mesh) if c.axes == (axis,)
               and (axis == "tensor" or c.kind != "all-reduce"))  # context: not the gradients' all-reduce


def analytic(sp: bool) -> float:
    f = FIELDS
    D, rq, r, R, N = f["d_model"], f["q_lora_rank"], f["kv_lora_rank"], f["qk_rope_head_dim"], B * T
    half = (t - 1) / t * beta  # one all-gather / reduce-scatter of one value a token
    if not sp:  # all-reduces (2 halves): attention g(D) forward, f's of cq, latent, k_rope backward; MLP g, f
        return N * 2 * half * (D + rq + r + R + 2 * D)
    # SP: attention forward gathers cq, latent, k_rope and reduce-scatters D; backward re-gathers cq and latent,
    # reduce-scatters their gradients and k_rope's, gathers dout. MLP: GQA's 5 halves of D. Plus the replicated
    # parameters' gradients (attn_norm, mlp_norm, q_a_norm, kv_a_norm, wq_a, wkv_a), all-reduced once a layer.
    tokens = N * half * (3 * rq + 3 * r + 2 * R + 2 * D + 5 * D)
    replicated = 2 * D + rq + r + D * rq + D * (r + R)
    return tokens + 2 * (t - 1) / t * 4 * replicated


if __name__ == "__main__":
    for sp in (False, True):
        four = tensor_bytes(4, sp)
        per_layer = (four - tensor_bytes(2, sp)) / 2
        cfg = config(4, sp)
        planned = expected.tensor_bytes(cfg, make_plan(cfg.model, cfg.parallel, jax.devices()[:t]).padded_vocab)
        print(f"tensor 2{' + SP' if sp else '     '}: whole step at 4 layers compiled {four:.0f} B, the planner's "
              f"expected.tensor_bytes {planned['total']:.0f} B ({four / planned['total']:.4f})")
        want = analytic(sp)
        print(f"tensor 2{' + SP' if sp else '     '}: compiled {per_layer:10.0f} B/layer, analytic {want:10.0f} "
              f"({per_layer / want:.4f}); B·T = {B * T} tokens, D {FIELDS['d_model']}, rq {FIELDS['q_lora_rank']}, "
              f"r {FIELDS['kv_lora_rank']}, R {FIELDS['qk_rope_head_dim']}")
    for impl in ("all_gather", "ring"):  # context 2 × tensor 2: the expanded per-head keys and values travel
        got = tensor_bytes(4, False, 2, impl, axis="context")
        want = expected.context_bytes(config(4, False, 2, impl))
        print(f"context 2 ({impl}) × tensor 2: context-axis bytes compiled {got:.0f}, expected.context_bytes "
              f"{want:.0f} ({got / want:.4f})")
