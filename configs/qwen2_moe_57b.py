"""qwen2_moe_57b: Qwen2-57B-A14B's shape (Qwen 2024: 28 layers, GQA 28/4 with q/k/v biases, 64 experts of 2560,
top 8 without renormalising, a gated shared expert of 20480, RoPE base 1e6) — for the planner and ahead-of-time
compilation; never run on a CPU.

    tokens per step      = batch_size * seq_len                  = 1024 * 4096            = 4,194,304 (4M)
    mesh on 128 GPUs     = data * pipe * expert * tensor         = 1 * 4 * 8 * 4          (data=-1 fills 128/128)
    pipeline             = 4 stages * 1 pass * 7 layers, 8 microbatches: bubble 3/11
    experts              = 64 over expert 8: 8 per rank, each 2560 wide split 4 ways (640 per GPU)
    per-rank chunk       = batch_size / (data * pipe * expert * grad_accum) = 1024 / (32 * 8) = 4 sequences
    parameters           = 2 * 151936*3584 + 28 * (attention 29.4M + router 229,376 + experts 64 * 27.5M + shared
                           220.2M + its gate 3584) ≈ 57.4B; active per token ≈ 14.2B (8 experts, the shared
                           one, the embedding)

Data: point data.tokenizer at Qwen2's tokenizer.json and data.source/data.path at your corpus.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # Qwen2-MoE is the Qwen2 layer (q/k/v biases) with a mixture of experts
    config.model.vocab_size = 151936  # Qwen2's tokenizer; 37984 rows per tensor shard
    config.model.d_model = 3584  # residual width h; head_dim derived = 128
    config.model.n_layers = 28  # every layer an MoE layer (decoder_sparse_step 1)
    config.model.n_heads = 28  # query heads; 7 per tensor shard
    config.model.n_kv_heads = 4  # GQA: 1 kv head per tensor shard
    config.model.d_ff = 18944  # (the dense width config.json carries; no layer is dense)
    config.model.qkv_bias = True  # Qwen2's q/k/v biases
    config.model.max_seq_len = 32768  # Qwen2's context
    config.model.rope_theta = 1000000.0  # Qwen2's RoPE base
    config.model.norm_eps = 1e-6  # Qwen2's rms_norm_eps
    config.model.dtype = "bfloat16"  # bf16 matmuls; fp32 master params, softmax and loss

    config.moe = ml_collections.ConfigDict()
    config.moe.n_experts = 64  # num_experts
    config.moe.top_k = 8  # num_experts_per_tok
    config.moe.d_ff = 2560  # moe_intermediate_size
    config.moe.norm_topk_prob = False  # Qwen2-MoE keeps the top-8 softmax probabilities as they are
    config.moe.shared_d_ff = 20480  # shared_expert_intermediate_size
    config.moe.shared_gate = True  # sigmoid(x . w) on the shared expert
    config.moe.aux_loss_coef = 0.001  # Qwen2-MoE's router_aux_loss_coef

    config.parallel = ml_collections.ConfigDict()
    config.parallel.pipe = 4  # 7 layers per stage
    config.parallel.microbatches = 8  # bubble (4 - 1)/(8 + 4 - 1) = 3/11
    config.parallel.expert = 8  # 8 experts per rank
    config.parallel.tensor = 4  # 28 heads and 4 kv heads: 4 is the largest degree dividing both
    config.parallel.remat = "full"  # recompute each layer in the backward

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 1024  # global sequences per step: 1024 * 4096 = 4M tokens
    config.train.seq_len = 4096  # tokens per sequence
    config.train.grad_accum = 4  # 1024 / (expert 8 * 4) = 32 rows per chunk: 8 microbatches of 4
    config.train.steps = 50000  # ≈ 210B tokens
    config.train.lr = 3e-4  # peak lr; cosine to 3e-5
    config.train.warmup_steps = 2000  # linear warmup
    config.train.eval_every = 1000  # held-out loss every 4B tokens

    config.data = ml_collections.ConfigDict()
    config.data.tokenizer = "bytes"  # placeholder: pass the path to Qwen2's tokenizer.json

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 500  # ≈ 2B tokens between checkpoints

    return config
