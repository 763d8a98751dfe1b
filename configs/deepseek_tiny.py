"""deepseek_tiny: a DeepSeek-V3-style model at the tiny size — multi-head latent attention with a latent KV cache,
a dense first layer, then DeepSeekMoE layers (fine-grained routed experts, a shared expert, sigmoid scoring with
group-limited selection) balanced without an auxiliary loss (the correction bias, updated after each step).

    tokens per step      = batch_size * seq_len = 32 * 128 = 4,096
    attention            = MLA: 4 heads, q through a rank-64 latent, k/v through a rank-32 latent; per head a
                           24-dim no-position part and a 8-dim RoPE part (the rope key shared by all heads), values 24
    KV cache per token   = kv_lora_rank + qk_rope_head_dim = 32 + 8 = 40 values a layer (a GQA model with these
                           4 heads of 32 would hold 2·4·32 = 256)
    layers               = 4: layer 0 a dense SwiGLU (first_k_dense_replace 1), layers 1–3 MoE
    experts              = 8 routed of width 88 in 4 groups of 2, a token's experts from the top 2 groups, top 2;
                           plus 1 shared expert of width 88 every token passes (active MLP width 3·88 = 264)
    balancing            = aux_loss_coef 0; e_score_correction_bias += 1e-2·sign(mean load − load) after each step.
                           γ = 1e-2, not DeepSeek-V3's 1e-3: its pretraining runs for ~10^5 steps, this for hundreds,
                           and at lr 3e-3 the router drifts faster than a 1e-3 bias follows — with 1e-3 the worst
                           MoE layer was still at max/mean load 3.9 at step 190 of 600 (the bias at ±0.17, moving
                           the right way), with 1e-2 it was under 1.3 by step 80 (bench/RESULTS.md, "Auxiliary-
                           loss-free balancing")
    mesh on 8 devices    = data * expert * tensor = 2 * 2 * 2 (a pipeline runs the dense first layer beside the
                           embedding and splits the 3 MoE layers: pipe 3, which 8 devices do not divide; with
                           model.n_layers=5, pipe 2 or 4)

    jaxpar train --config configs/deepseek_tiny.py --workdir /tmp/deepseek_tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "deepseek"  # MLA attention, DeepSeekMoE
    config.model.vocab_size = 256  # one id per byte (the byte tokenizer)
    config.model.d_model = 128  # residual width h
    config.model.n_layers = 4  # layer 0 dense, 1-3 MoE
    config.model.n_heads = 4  # query heads; 2 per tensor shard
    config.model.q_lora_rank = 64  # queries through a low-rank latent (DeepSeek-V3; 0: projected directly, V2-Lite)
    config.model.kv_lora_rank = 32  # the latent the KV cache holds
    config.model.qk_rope_head_dim = 8  # the RoPE part of each query head, and of the one shared key
    config.model.qk_nope_head_dim = 24  # the position-free part of each query/key head
    config.model.v_head_dim = 24  # value width per head
    config.model.d_ff = 352  # the dense first layer's SwiGLU (tiny's width)
    config.model.max_seq_len = 256  # twice train.seq_len, for sampling past it

    config.moe = ml_collections.ConfigDict()
    config.moe.n_experts = 8  # routed experts per MoE layer, split over 'expert'
    config.moe.top_k = 2  # experts each token is sent to
    config.moe.d_ff = 88  # fine-grained: each routed expert a quarter of tiny's MLP
    config.moe.shared_d_ff = 88  # one shared expert (n_shared_experts 1 of moe_intermediate_size 88)
    config.moe.dense_layers = (0,)  # first_k_dense_replace = 1
    config.moe.scoring = "sigmoid"  # DeepSeek-V3's expert affinities
    config.moe.n_group = 4  # 8 experts in 4 groups of 2
    config.moe.topk_group = 2  # a token's experts come from its 2 best groups
    config.moe.norm_topk_prob = True  # gates renormalised over the chosen experts
    config.moe.routed_scale = 2.5  # routed_scaling_factor
    config.moe.correction_bias = True  # e_score_correction_bias: selection only, never the gate values
    config.moe.bias_update_rate = 0.01  # gamma of auxiliary-loss-free balancing (V3 used 1e-3 over far more steps)
    config.moe.aux_loss_coef = 0.0  # no auxiliary loss
    config.moe.capacity_factor = 0.0  # dropless

    config.parallel = ml_collections.ConfigDict()
    config.parallel.data = -1  # fill: 2 on 8 devices
    config.parallel.expert = 2  # 4 experts per expert rank
    config.parallel.tensor = 2  # heads and expert columns split 2 ways

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 32  # global sequences per step: 4,096 tokens
    config.train.seq_len = 128  # tokens per sequence
    config.train.steps = 600  # tiny's schedule
    config.train.lr = 3e-3  # tiny's peak lr
    config.train.warmup_steps = 50  # linear warmup, then cosine
    config.train.log_every = 10  # a metrics.jsonl line (with the expert load) every 10 steps
    config.train.eval_every = 100  # held-out loss 6 times per run

    config.data = ml_collections.ConfigDict()
    config.data.source = "default"  # the embedded corpus
    config.data.tokenizer = "bytes"  # raw UTF-8 bytes, vocab 256

    return config
