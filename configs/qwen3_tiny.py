"""qwen3_tiny: a byte-level Qwen3-MoE — moe_tiny's experts with Qwen3's attention: the q/k norm (RMSNorm on each
query and key head before RoPE) and an explicit head_dim wider than d_model / n_heads.

It exports as Qwen3MoeForCausalLM (`jaxpar convert --from W --to-hf DIR`), which transformers loads.

    tokens per step      = batch_size * seq_len          = 32 * 128      = 4,096
    mesh on 8 devices    = data * pipe * expert * tensor  = 1 * 2 * 2 * 2 (data=-1 fills 8 / (2*2*2) = 1)
    rows per device      = batch_size / (data*pipe*expert) = 32 / 4      = 8 per step; 4 microbatches of 4 rows
    attention            = 4 query heads and 2 kv heads of head_dim 48 (4·48 = 192 > d_model 128: Qwen3's
                           head_dim is its own field); q_norm, k_norm [48] per layer
    experts              = 8 of width 176, top 2 renormalised (Qwen3-MoE's norm_topk_prob), no shared expert
    parameters           = 2 * 256*128 (embed, head) + 4 * (attention 2·128·192 + 2·128·96 + 2·48 + router 1,024 +
                           experts 540,672 + 2 norms 256) + 128 = 2,528,768 total, 906,752 active

    jaxpar train --config configs/qwen3_tiny.py --workdir /tmp/qwen3_tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # RMSNorm, RoPE, SwiGLU experts, GQA: Qwen3-MoE's layer with the q/k norm
    config.model.vocab_size = 256  # one id per byte (the byte tokenizer)
    config.model.d_model = 128  # residual width h
    config.model.n_layers = 4  # every layer an MoE layer
    config.model.n_heads = 4  # query heads; 2 per tensor shard
    config.model.n_kv_heads = 2  # GQA: 1 kv head per tensor shard
    config.model.head_dim = 48  # explicit, as Qwen3's (not d_model / n_heads = 32)
    config.model.qk_norm = True  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    config.model.norm_eps = 1e-6  # Qwen3's rms_norm_eps
    config.model.rope_theta = 1e6  # Qwen3's base
    config.model.max_seq_len = 256  # twice train.seq_len, for sampling past it

    config.moe = ml_collections.ConfigDict()
    config.moe.n_experts = 8  # routed experts per layer, split over 'expert'
    config.moe.top_k = 2  # softmax over the 8, top 2
    config.moe.norm_topk_prob = True  # renormalised, as released Qwen3-MoE models set it
    config.moe.d_ff = 176  # 2 active experts of 176 = tiny's one MLP of 352
    config.moe.aux_loss_coef = 0.001  # Qwen3-MoE's router_aux_loss_coef
    config.moe.capacity_factor = 0.0  # dropless

    config.parallel = ml_collections.ConfigDict()
    config.parallel.data = -1  # fill: 1 on 8 devices
    config.parallel.pipe = 2  # circular pipeline over 2 stages
    config.parallel.expert = 2  # 4 experts per expert rank
    config.parallel.tensor = 2  # heads and each expert's columns split in two
    config.parallel.repeats = 2  # 4 layers = 2 stages * 2 passes * 1 layer
    config.parallel.microbatches = 4  # 16 rows per (data, expert) rank -> 4 microbatches of 4

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 32  # global sequences per step: 4,096 tokens
    config.train.seq_len = 128  # tokens per sequence
    config.train.steps = 600  # tiny's schedule, for the side-by-side curve
    config.train.lr = 3e-3  # tiny's peak lr
    config.train.warmup_steps = 50  # linear warmup, then cosine
    config.train.log_every = 10  # a metrics.jsonl line every 10 steps
    config.train.eval_every = 100  # held-out loss 6 times per run

    config.data = ml_collections.ConfigDict()
    config.data.source = "default"  # the embedded corpus
    config.data.tokenizer = "bytes"  # raw UTF-8 bytes, vocab 256

    return config
