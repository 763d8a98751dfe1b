"""llama_8b: Llama-3-8B's shape (Meta 2024: 32 layers, GQA 32/8, SwiGLU 14336, untied embeddings, RoPE base 500k).

    tokens per step      = batch_size * seq_len                = 512 * 8192            = 4,194,304 (4M)
    mesh on 64 GPUs      = data * tensor                       = 8 * 8                 (data=-1 fills 64 / 8)
    per-replica chunk    = batch_size / (data * grad_accum)    = 512 / (8 * 16)        = 4 sequences of 8192
    tokens per run       = tokens per step * steps             = 4,194,304 * 40,000    ≈ 168B (≈ 21 per parameter)
    parameters           = 2 * 128256*4096 (embed, head) + 32 * 218,112,000 (layers) + 4096 ≈ 8.03B
                           (a layer: q,o 4096*4096 each + k,v 4096*1024 each + SwiGLU 3*4096*14336 + 2 norms)
    optimizer state      = 8.03B * 16 bytes (fp32 params, grads, Adam m and v) ≈ 128 GB, ≈ 16 GB per tensor shard

Tensor parallelism stays inside one 8-GPU host (NVLink); data parallelism runs across hosts. Full remat keeps only
each layer's input (8192 * 4 * 4096 * 2 bytes = 268 MB per layer per replica) and recomputes the rest.

Data: point data.tokenizer at Llama 3's tokenizer.json and data.source/data.path at your corpus; the byte
tokenizer is a placeholder that lets the preset run out of the box.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # RMSNorm, RoPE, SwiGLU, GQA
    config.model.vocab_size = 128256  # Llama 3's tokenizer; 128256 / 8 = 16032 rows per tensor shard
    config.model.d_model = 4096  # residual width h; head_dim derived = 4096 / 32 = 128
    config.model.n_layers = 32  # transformer blocks L
    config.model.n_heads = 32  # query heads; 4 per tensor shard
    config.model.n_kv_heads = 8  # GQA: 4 query heads per kv head; exactly 1 kv head per tensor shard
    config.model.d_ff = 14336  # SwiGLU hidden width (3.5 * d_model); 1792 per tensor shard
    config.model.max_seq_len = 8192  # Llama 3's pre-training context
    config.model.rope_theta = 500000.0  # Llama 3's RoPE base, for long contexts
    config.model.dtype = "bfloat16"  # bf16 matmuls; fp32 master params, softmax and loss

    config.parallel = ml_collections.ConfigDict()
    config.parallel.tensor = 8  # one host's 8 GPUs; the 8 kv heads give 1 per shard, so 8 is the largest degree
    config.parallel.remat = "full"  # recompute each layer in the backward; 8k-token activations do not fit otherwise

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 512  # global sequences per step: 512 * 8192 = 4M tokens
    config.train.seq_len = 8192  # full context
    config.train.grad_accum = 16  # 16 sequential chunks: 4 sequences per replica per chunk with data=8
    config.train.steps = 40000  # 40,000 * 4M ≈ 168B tokens, about Chinchilla's 20 tokens per parameter
    config.train.lr = 3e-4  # Llama 3 8B's peak lr; cosine decays to 3e-5 (min_lr_ratio 0.1)
    config.train.warmup_steps = 2000  # Llama's warmup
    config.train.eval_every = 1000  # held-out loss 40 times per run

    config.data = ml_collections.ConfigDict()
    config.data.tokenizer = "bytes"  # placeholder: pass the path to Llama 3's tokenizer.json

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 500  # ≈ 2B tokens between checkpoints; a lost step costs 64 GPUs

    return config
