"""Cache bytes per token and layer of the MLA latent cache against the equivalent GQA model's (same heads, head width
Eqk, K = H), from the compiled explicit decode program: its cache arguments' per-device shards and XLA's argument
size (memory_analysis), at (data, tensor) = (1, 1) and (1, 2).

    PYTHONPATH=. python bench/mla_cache_bytes.py
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.config import ModelConfig, ParallelConfig  # noqa: E402
from jaxpar.infer import decode  # noqa: E402
from jaxpar.model import Transformer  # noqa: E402
from jaxpar.plan import make_plan  # noqa: E402

MLA = ModelConfig(family="deepseek", vocab_size=256, d_model=64, n_layers=2, n_heads=4, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24, d_ff=96, max_seq_len=64)
GQA = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, head_dim=24, d_ff=96, max_seq_len=64)
BATCH, SLOTS = 4, 64

for name, cfg in (("mla", MLA), ("gqa", GQA)):
    for tensor in (1, 2):
        plan = make_plan(cfg, ParallelConfig(data=1, tensor=tensor), jax.devices()[:tensor])
        model = Transformer(cfg, rngs=nnx.Rngs(0), padded_vocab=plan.padded_vocab)
        fn, args = decode.explicit_decode_step(model, plan, batch=BATCH, slots=SLOTS, temperature=0.0, top_k=0,
                                               top_p=1.0)
        cache = sum(a.addressable_shards[0].data.nbytes for a in args[2].values())
        mem = fn.lower(*args).compile().memory_analysis()
        arg = getattr(mem, "argument_size_in_bytes", None)
        per = cache / (cfg.n_layers * BATCH * SLOTS)
        print(f"{name} tensor {tensor}: cache {cache} B per device = {per:.0f} B a token a layer; compiled "
              f"arguments {arg} B a device, of which the cache {cache}")
