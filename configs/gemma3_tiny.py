"""gemma3_tiny: a byte-level Gemma 3 — its layer (RMSNorm of 1 + w before and after attention and the MLP, the q/k
norm, √d embeddings, a GeGLU MLP, scores scaled by 1/√query_pre_attn_scalar) and its attention pattern: sliding
window layers with a local RoPE base between full layers with the global base (2:1 here, 5:1 in the released models).

It exports as Gemma3ForCausalLM (`jaxpar convert --from W --to-hf DIR`), which transformers loads.

    tokens per step      = batch_size * seq_len          = 32 * 128      = 4,096
    mesh on 8 devices    = data * pipe * tensor          = 2 * 2 * 2 (data=-1 fills 8 / (2*2) = 2), SP on
    rows per device      = batch_size / (data*pipe)      = 32 / 4        = 8 per step; 4 microbatches of 4 rows
    layers               = 6: (sliding, sliding, full) twice — each pipeline stage holds one such period
    attention            = 4 query heads and 2 kv heads of head_dim 48; windows of 32 < seq_len 128
    parameters           = 256*128 (embed, tied) + 6 * (attention 2·128·192 + 2·128·96 + 2·48 + MLP 3·128·352 +
                           4 norms 512) + 128 = 1,289,920

    jaxpar train --config configs/gemma3_tiny.py --workdir /tmp/gemma3_tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "gemma"  # RMSNorm (1 + w) pre and post, √d embeddings, GeGLU, GQA
    config.model.vocab_size = 256  # one id per byte (the byte tokenizer)
    config.model.d_model = 128  # residual width h
    config.model.n_layers = 6  # layers 2 and 5 full, the others windowed
    config.model.n_heads = 4  # query heads; 2 per tensor shard
    config.model.n_kv_heads = 2  # GQA: 1 kv head per tensor shard
    config.model.head_dim = 48  # explicit, as Gemma's (not d_model / n_heads = 32)
    config.model.d_ff = 352  # tiny's MLP width
    config.model.qk_norm = True  # Gemma 3: RMSNorm (1 + w) over head_dim on q and k, before RoPE
    config.model.query_pre_attn_scalar = 32.0  # scores / √32 (Gemma 3 27B's d_model / n_heads), not / √48
    config.model.sliding_window = 32  # the windowed layers see the last 32 positions
    config.model.full_attention_every = 3  # layer i is full when (i + 1) % 3 == 0
    config.model.local_rope_theta = 1e4  # the windowed layers' RoPE base (Gemma's rope_local_base_freq)
    config.model.rope_theta = 1e6  # the full layers' (Gemma's global base)
    config.model.norm_eps = 1e-6  # Gemma's rms_norm_eps
    config.model.tie_embeddings = True  # Gemma ties the head to the embedding
    config.model.max_seq_len = 256  # twice train.seq_len, for sampling past it

    config.parallel = ml_collections.ConfigDict()
    config.parallel.data = -1  # fill: 2 on 8 devices
    config.parallel.pipe = 2  # circular pipeline over 2 stages, 3 layers each
    config.parallel.tensor = 2  # heads and MLP columns split in two
    config.parallel.sequence_parallel = True  # norms (all four) and residual adds on sequence shards
    config.parallel.microbatches = 4  # 16 rows per data rank -> 4 microbatches of 4

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
