"""gpt2_small: GPT-2 124M with nanoGPT's OpenWebText recipe (Radford et al. 2019; nanoGPT `config/train_gpt2.py`).

    tokens per step      = batch_size * seq_len                = 480 * 1024        = 491,520 (≈0.5M, GPT-3 small's)
    per-device chunk     = batch_size / (data * grad_accum)    = 480 / (8 * 5)     = 12 sequences on 8 GPUs
                           (nanoGPT: micro-batch 12 * grad_accum 5 * 8 GPUs = 480)
    tokens per run       = tokens per step * steps             = 491,520 * 600,000 ≈ 295B
    parameters           = 50304*768 (tied embed/head) + 1024*768 (positions) + 12 * 7,087,872 (layers) + 1,536
                         ≈ 124.5M   (a layer: attention 4*768^2 + MLP 2*768*3072, plus biases and 2 LayerNorms)
    vocab                = 50257 (GPT-2's BPE) is odd, so no even tensor degree divides it: padded to 50304;
                           the 47 extra rows are never produced by the tokenizer and learn to be unlikely
    FLOPs per token      ≈ 6 * 124.5M + 12 * 12 * 768 * 1024 ≈ 0.86 GFLOP (training; PaLM's formula, full attention)

Data: point data.source="tokens" and data.path at pre-tokenized OpenWebText, and data.tokenizer at GPT-2's
tokenizer.json; the byte tokenizer kept here is a placeholder that lets the preset run out of the box.

    jaxpar train --config configs/gpt2_small.py --workdir /tmp/gpt2 \
        --config.data.source=tokens --config.data.path=owt/train.bin --config.data.tokenizer=gpt2/tokenizer.json
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "gpt2"  # LayerNorm, learned positions, GELU, biases
    config.model.vocab_size = 50304  # GPT-2's 50257 padded to 2^7 * 393: any power-of-2 tensor <= 128 divides it
    config.model.d_model = 768  # residual width h; head_dim = 768 / 12 = 64, d_ff derived = 4 * 768 = 3072
    config.model.n_layers = 12  # transformer blocks L
    config.model.n_heads = 12  # attention heads (no GQA in GPT-2)
    config.model.max_seq_len = 1024  # GPT-2's context: the learned position table has 1024 rows
    config.model.tie_embeddings = True  # GPT-2 shares the token embedding with the LM head
    config.model.dtype = "bfloat16"  # bf16 matmuls; fp32 master params, softmax and loss

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 480  # global sequences per step: 480 * 1024 ≈ 0.5M tokens
    config.train.seq_len = 1024  # full context
    config.train.grad_accum = 5  # 5 sequential chunks: 12 sequences per device per chunk on 8 GPUs
    config.train.steps = 600000  # nanoGPT's max_iters: ≈ 295B tokens
    config.train.lr = 6e-4  # GPT-3 small's peak lr; cosine decays to 6e-5 (min_lr_ratio 0.1)
    config.train.warmup_steps = 2000  # nanoGPT's warmup_iters
    config.train.eval_every = 2000  # nanoGPT's eval_interval
    config.train.eval_batches = 20  # 20 * 480 sequences ≈ 10M held-out tokens per evaluation

    config.data = ml_collections.ConfigDict()
    config.data.tokenizer = "bytes"  # placeholder: pass the path to GPT-2's tokenizer.json (50257 ids fit in 50304)

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 2000  # save at each evaluation, like nanoGPT

    return config
