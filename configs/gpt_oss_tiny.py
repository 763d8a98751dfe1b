"""gpt_oss_tiny: a byte-level gpt-oss — its attention (q/k/v/o biases, a learned sink logit per head, sliding-window
and full layers alternating, YaRN with unrounded ramp ends) and its experts (a router bias, expert biases, the
clamped SwiGLU (clip(up, ±7) + 1)·g·σ(1.702·g), g = min(gate, 7), top-k renormalised).

It exports as GptOssForCausalLM (`jaxpar convert --from W --to-hf DIR`), which transformers loads.

    tokens per step      = batch_size * seq_len          = 32 * 128      = 4,096
    mesh on 8 devices    = data * pipe * expert * tensor  = 1 * 2 * 2 * 2 (data=-1 fills 8 / (2*2*2) = 1)
    rows per device      = batch_size / (data*pipe*expert) = 32 / 4      = 8 per step; 4 microbatches of 4
    layers               = 4: (sliding, full) twice — each pipeline stage holds one such pair
    attention            = 4 query heads and 2 kv heads of head_dim 32, a window of 32 < seq_len 128
    experts              = 8 of width 176, top 2 renormalised, with biases; no shared expert
    parameters           = 2 * 256*128 (embed, head) + 4 * (attention 2·128·128 + 2·128·64 + biases 128 + 64 + 64
                           + 128 + sinks 4 + router 1,024 + 8 + experts 540,672 + biases 8·(2·176 + 128) + 2 norms
                           256) + 128 = 2,447,024

    jaxpar train --config configs/gpt_oss_tiny.py --workdir /tmp/gpt_oss_tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # RMSNorm, RoPE, GQA, SwiGLU experts: gpt-oss's layer with its options below
    config.model.vocab_size = 256  # one id per byte (the byte tokenizer)
    config.model.d_model = 128  # residual width h
    config.model.n_layers = 4  # every layer an MoE layer; layers 1 and 3 full, 0 and 2 windowed
    config.model.n_heads = 4  # query heads; 2 per tensor shard
    config.model.n_kv_heads = 2  # GQA: 1 kv head per tensor shard
    config.model.qkv_bias = True  # gpt-oss's attention_bias: q, k, v ...
    config.model.o_bias = True  # ... and o
    config.model.attention_sinks = True  # a learned logit per head in the softmax's denominator
    config.model.sliding_window = 32  # the windowed layers see the last 32 positions
    config.model.full_attention_every = 2  # layer i is full when (i + 1) % 2 == 0
    config.model.rope_theta = 150000.0  # gpt-oss's base
    config.model.rope_scaling = "yarn"  # YaRN, as gpt-oss (factor 32 over 4,096 there; 4 over 64 here)
    config.model.rope_factor = 4.0  # the context-extension factor
    config.model.rope_original_max_len = 64  # the pre-extension context
    config.model.rope_truncate = False  # gpt-oss keeps the ramp's ends fractional
    config.model.max_seq_len = 256  # twice train.seq_len, for sampling past it

    config.moe = ml_collections.ConfigDict()
    config.moe.n_experts = 8  # routed experts per layer, split over 'expert'
    config.moe.top_k = 2  # the top 2 logits, softmaxed (gpt-oss: 4 of 32 or 128)
    config.moe.d_ff = 176  # 2 active experts of 176 = tiny's one MLP of 352
    config.moe.router_bias = True  # gpt-oss's router has a bias
    config.moe.expert_bias = True  # and its experts' gate, up and down projections
    config.moe.swiglu_limit = 7.0  # the clamped SwiGLU: gate <= 7, |up| <= 7
    config.moe.swiglu_alpha = 1.702  # gate · σ(1.702 · gate), as gpt-oss
    config.moe.aux_loss_coef = 0.01  # load balancing
    config.moe.capacity_factor = 0.0  # dropless

    config.parallel = ml_collections.ConfigDict()
    config.parallel.data = -1  # fill: 1 on 8 devices
    config.parallel.pipe = 2  # circular pipeline over 2 stages
    config.parallel.expert = 2  # 4 experts per expert rank
    config.parallel.tensor = 2  # heads and each expert's columns split in two
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
