"""mixtral_8x7b: Mixtral-8x7B's shape (Mistral AI 2024: 32 layers, GQA 32/8, 8 SwiGLU experts of 14336, top 2,
untied embeddings, RoPE base 1e6) — for the planner and ahead-of-time compilation; never run on a CPU.

    tokens per step      = batch_size * seq_len                     = 1024 * 4096       = 4,194,304 (4M)
    mesh on 64 GPUs      = data * expert * tensor                   = 1 * 8 * 8         (data=-1 fills 64 / 64)
    experts              = 8 over expert 8: one per rank, its 14336 columns split 8 ways (1792 per GPU)
    per-rank chunk       = batch_size / (data * expert * grad_accum) = 1024 / (8 * 32)  = 4 sequences of 4096
    parameters           = 2 * 32000*4096 + 32 * (attention 41.9M + router 32,768 + experts 8 * 176.2M) ≈ 46.7B;
                           active per token: 2 of 8 experts ≈ 12.9B (FLOPs count these: jaxpar.flops)
    optimizer state      = 46.7B * 16 bytes ≈ 747 GB, ≈ 11.7 GB per GPU (everything is split 64 ways but the
                           attention and router, split 8 ways over tensor only)

Tensor parallelism stays inside one 8-GPU host (NVLink); the all-to-alls of expert parallelism cross hosts.
Data: point data.tokenizer at Mixtral's tokenizer.json and data.source/data.path at your corpus.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # Mixtral is the Llama layer with its MLP a mixture of experts
    config.model.vocab_size = 32000  # Mistral's tokenizer; 4000 rows per tensor shard
    config.model.d_model = 4096  # residual width h; head_dim derived = 128
    config.model.n_layers = 32  # every layer an MoE layer
    config.model.n_heads = 32  # query heads; 4 per tensor shard
    config.model.n_kv_heads = 8  # GQA: 1 kv head per tensor shard
    config.model.d_ff = 14336  # (the dense width config.json repeats; no layer is dense)
    config.model.max_seq_len = 32768  # Mixtral's context
    config.model.rope_theta = 1000000.0  # Mixtral's RoPE base
    config.model.dtype = "bfloat16"  # bf16 matmuls; fp32 master params, softmax and loss

    config.moe = ml_collections.ConfigDict()
    config.moe.n_experts = 8  # num_local_experts
    config.moe.top_k = 2  # num_experts_per_tok: softmax, top 2, renormalised
    config.moe.d_ff = 14336  # each expert's SwiGLU width
    config.moe.aux_loss_coef = 0.02  # Mixtral's router_aux_loss_coef

    config.parallel = ml_collections.ConfigDict()
    config.parallel.expert = 8  # one expert per rank; the 8 expert ranks are data-parallel outside the MoE layers
    config.parallel.tensor = 8  # one host's 8 GPUs
    config.parallel.remat = "full"  # recompute each layer in the backward

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 1024  # global sequences per step: 1024 * 4096 = 4M tokens
    config.train.seq_len = 4096  # tokens per sequence
    config.train.grad_accum = 32  # 4 sequences per expert rank per chunk
    config.train.steps = 50000  # 50,000 * 4M ≈ 210B tokens
    config.train.lr = 3e-4  # peak lr; cosine to 3e-5
    config.train.warmup_steps = 2000  # linear warmup
    config.train.eval_every = 1000  # held-out loss every 4B tokens

    config.data = ml_collections.ConfigDict()
    config.data.tokenizer = "bytes"  # placeholder: pass the path to Mixtral's tokenizer.json

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 500  # ≈ 2B tokens between checkpoints

    return config
