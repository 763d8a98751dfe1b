"""tiny: the default demo and test model, a byte-level Llama of 0.80M parameters that trains in minutes on a CPU.

    tokens per step      = batch_size * seq_len          = 32 * 128      = 4,096
    tokens per run       = tokens per step * steps        = 4,096 * 600   ≈ 2.5M
    mesh on 8 devices    = data * pipe * tensor           = 2 * 2 * 2      (data=-1 fills 8 / (2*2) = 2)
    rows per data shard  = batch_size / data              = 32 / 2        = 16 per step
    microbatches         = 4 of 16 / 4 = 4 rows; each pipeline stage embeds (and finally holds) 4 / 2 = 2 of them
    pipeline             = 2 stages * 2 passes * 1 layer  = 4 layers;  iterations = 2*4 + 2 - 1 = 9, bubble 1/9
    parameters           = 2 * 256*128 (embed, untied head) + 4 * 184,576 (layers) + 128 (final norm) ≈ 0.80M
                           (a layer: q,o 128*128 each + k,v 128*64 each (2 kv heads of 32) + SwiGLU 3*128*352 + 2 norms)

Most keys equal the dataclass defaults; they are spelled out because this preset is the one people read first.

    jaxpar train --config configs/tiny.py --workdir /tmp/tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "llama"  # RMSNorm, RoPE, SwiGLU, GQA
    config.model.vocab_size = 256  # one id per byte (the byte tokenizer)
    config.model.d_model = 128  # residual width h; head_dim = 128 / 4 = 32, d_ff derived = 352
    config.model.n_layers = 4  # transformer blocks L
    config.model.n_heads = 4  # query heads; 2 per tensor shard
    config.model.n_kv_heads = 2  # GQA: 2 query heads per kv head; 1 kv head per tensor shard
    config.model.max_seq_len = 256  # twice train.seq_len, so sampling can run past the training length

    config.parallel = ml_collections.ConfigDict()
    config.parallel.data = -1  # fill the devices left after pipe and tensor: 2 on 8 devices
    config.parallel.pipe = 2  # circular pipeline over 2 stages
    config.parallel.tensor = 2  # Megatron tensor parallelism over pairs of devices
    config.parallel.repeats = 2  # 2 passes through the stages: 4 layers = 2 stages * 2 passes * 1 layer
    config.parallel.microbatches = 4  # 16 rows per data shard -> 4 microbatches of 4; bubble 1/(2*4+1) = 11%

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 32  # global sequences per step: 32 * 128 = 4,096 tokens
    config.train.seq_len = 128  # tokens per sequence
    config.train.steps = 600  # 600 * 4,096 ≈ 2.5M tokens
    config.train.lr = 3e-3  # peak lr; small models tolerate a large one
    config.train.warmup_steps = 50  # linear warmup, then cosine to lr * min_lr_ratio
    config.train.log_every = 10  # a metrics.jsonl line every 10 steps
    config.train.eval_every = 100  # held-out loss 6 times per run

    config.data = ml_collections.ConfigDict()
    config.data.source = "default"  # the embedded corpus: this Python's stdlib sources
    config.data.tokenizer = "bytes"  # raw UTF-8 bytes, matches vocab_size 256

    return config
