"""llama_1b: a Llama-3.2-1B-shaped model (Meta 2024: 16 layers, GQA 32/8, tied embeddings, RoPE base 500k).

    tokens per step      = batch_size * seq_len                = 512 * 2048            = 1,048,576 (1M)
    mesh on 8 GPUs       = data * tensor                       = 4 * 2                 (data=-1 fills 8 / 2)
    per-replica chunk    = batch_size / (data * grad_accum)    = 512 / (4 * 32)        = 4 sequences of 2048
    tokens per run       = tokens per step * steps             = 1,048,576 * 25,000    ≈ 26B (≈ 21 per parameter)
    parameters           = 128256*2048 (tied embed/head) + 16 * 60,821,504 (layers) + 2048 ≈ 1.24B
                           (a layer: q,o 2048*2048 each + k,v 2048*512 each + SwiGLU 3*2048*8192 + 2 norms)
    optimizer state      = 1.24B * 16 bytes (fp32 params, grads, Adam m and v) ≈ 20 GB, ≈ 10 GB per tensor shard

Data: point data.tokenizer at Llama 3's tokenizer.json and data.source/data.path at your corpus; the byte
tokenizer is a placeholder that lets the preset run out of the box.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # RMSNorm, RoPE, SwiGLU, GQA
    config.model.vocab_size = 128256  # Llama 3's tokenizer; 128256 = 2^8 * 501 suits any power-of-2 tensor <= 256
    config.model.d_model = 2048  # residual width h
    config.model.n_layers = 16  # transformer blocks L
    config.model.n_heads = 32  # query heads; 16 per tensor shard
    config.model.n_kv_heads = 8  # GQA: 4 query heads per kv head; 4 kv heads per tensor shard
    config.model.head_dim = 64  # = 2048 / 32, written out as in the HF config
    config.model.d_ff = 8192  # SwiGLU hidden width (4 * d_model, not the derived 8/3 * d_model)
    config.model.max_seq_len = 8192  # Llama 3's pre-training context (3.2 extends it with RoPE scaling, not modelled)
    config.model.rope_theta = 500000.0  # Llama 3's RoPE base, for long contexts
    config.model.tie_embeddings = True  # Llama 3.2 1B shares the embedding with the LM head
    config.model.dtype = "bfloat16"  # bf16 matmuls; fp32 master params, softmax and loss

    config.parallel = ml_collections.ConfigDict()
    config.parallel.tensor = 2  # halves the 20 GB of params+optimizer state per device; tensor=1 also fits on 80 GB

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 512  # global sequences per step: 512 * 2048 = 1M tokens
    config.train.seq_len = 2048  # training context; max_seq_len stays 8192
    config.train.grad_accum = 32  # 32 sequential chunks: 4 sequences per replica per chunk with data=4
    config.train.steps = 25000  # 25,000 * 1M ≈ 26B tokens, about Chinchilla's 20 tokens per parameter
    config.train.lr = 3e-4  # peak lr; cosine decays to 3e-5 (min_lr_ratio 0.1)
    config.train.warmup_steps = 2000  # Llama's warmup
    config.train.eval_every = 1000  # held-out loss 25 times per run

    config.data = ml_collections.ConfigDict()
    config.data.tokenizer = "bytes"  # placeholder: pass the path to Llama 3's tokenizer.json

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 1000  # ≈ 1B tokens between checkpoints

    return config
