"""moe_tiny: the tiny Llama with every MLP a mixture of 8 SwiGLU experts, top 2 — the MoE demo and test model.

Equal *active* parameters with configs/tiny.py: each token runs 2 experts of width 176, i.e. 2·3·128·176 = 135,168
MLP weights, against tiny's one SwiGLU of width 352 (3·128·352 = 135,168): the same FLOPs per token (plus the router,
128·8). The MoE holds 4× tiny's MLP parameters in total.

    tokens per step      = batch_size * seq_len          = 32 * 128      = 4,096
    mesh on 8 devices    = data * pipe * expert * tensor  = 1 * 2 * 2 * 2 (data=-1 fills 8 / (2*2*2) = 1)
    rows per device      = batch_size / (data*pipe*expert) = 32 / 4      = 8 per step; 4 microbatches of 4 rows
    experts              = 8, 4 per expert rank, each split over 2 tensor ranks (88 columns each)
    parameters           = 2 * 256*128 (embed, head) + 4 * (attention 49,152 + router 1,024 + experts 540,672 +
                           2 norms 256) + 128 ≈ 2.43M total, ≈ 0.80M active (tiny: 0.80M)
    load balancing       = aux_loss_coef 0.01 (Switch), dropless

    jaxpar train --config configs/moe_tiny.py --workdir /tmp/moe_tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # RMSNorm, RoPE, SwiGLU experts, GQA
    config.model.vocab_size = 256  # one id per byte (the byte tokenizer)
    config.model.d_model = 128  # residual width h; head_dim 32
    config.model.n_layers = 4  # every layer an MoE layer
    config.model.n_heads = 4  # query heads; 2 per tensor shard
    config.model.n_kv_heads = 2  # GQA: 1 kv head per tensor shard
    config.model.max_seq_len = 256  # twice train.seq_len, for sampling past it

    config.moe = ml_collections.ConfigDict()
    config.moe.n_experts = 8  # routed experts per layer, split over 'expert'
    config.moe.top_k = 2  # Mixtral's routing: softmax, top 2, renormalised
    config.moe.d_ff = 176  # 2 active experts of 176 = tiny's one MLP of 352 (equal active parameters)
    config.moe.aux_loss_coef = 0.01  # Switch load-balancing loss
    config.moe.capacity_factor = 0.0  # dropless

    config.parallel = ml_collections.ConfigDict()
    config.parallel.data = -1  # fill: 1 on 8 devices
    config.parallel.pipe = 2  # circular pipeline over 2 stages
    config.parallel.expert = 2  # 4 experts per expert rank; its ranks are data-parallel outside the MoE layers
    config.parallel.tensor = 2  # each expert's 176 columns split 88 + 88
    config.parallel.repeats = 2  # 4 layers = 2 stages * 2 passes * 1 layer
    config.parallel.microbatches = 4  # 16 rows per (data, expert) rank -> 4 microbatches of 4

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 32  # global sequences per step: 4,096 tokens
    config.train.seq_len = 128  # tokens per sequence
    config.train.steps = 600  # tiny's schedule, for the side-by-side curve
    config.train.lr = 3e-3  # tiny's peak lr
    config.train.warmup_steps = 50  # linear warmup, then cosine
    config.train.log_every = 10  # a metrics.jsonl line (with the expert load) every 10 steps
    config.train.eval_every = 100  # held-out loss 6 times per run

    config.data = ml_collections.ConfigDict()
    config.data.source = "default"  # the embedded corpus
    config.data.tokenizer = "bytes"  # raw UTF-8 bytes, vocab 256

    return config
