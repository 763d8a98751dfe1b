"""deepseek_v3: DeepSeek-V3's shape (DeepSeek-AI 2024: 61 layers, d 7168, 128 heads of multi-head latent attention,
the first 3 layers dense, then 256 routed experts of 2048 plus one shared, top 8 from 4 of 8 groups, sigmoid
scoring with auxiliary-loss-free balancing, YaRN RoPE) — for the planner and ahead-of-time compilation
(`jaxpar plan --config configs/deepseek_v3.py --devices 256 --verify`); never run on a CPU.

    tokens per step      = batch_size * seq_len = 256 * 4096 = 1,048,576 (1M)
    attention            = q through a rank-1536 latent, k/v through a rank-512 latent; per head 128 position-free
                           + 64 RoPE dims (the rope key shared by all heads), values 128
    KV cache per token   = 512 + 64 = 576 values a layer (the same 128 heads as GQA-128 would hold 2·128·128 = 32,768)
    experts              = 256 routed over expert 32 (8 per rank), each split over tensor 8 (256 columns per GPU)
    parameters           = 671.0B total, 37.6B active per token (count_params; tests/test_config.py); model.mtp_depth
                           is 0 here: the checkpoint's one MTP module (14B more) is not trained by this preset

Training layout here: data * expert * tensor = 1 * 32 * 8 = 256 (tensor inside each 8-GPU host); no pipeline (one
would run the 3 dense layers beside the embedding and split the 58 MoE layers over 2, 29 or 58 stages), no ZeRO (it
shards over 'data', size 1 here).
`plan --verify` with this layout kept: 956.3 GB predicted for XLA:CPU against 915.8 compiled (+4.4 %), 170.5 GB
predicted on a GPU (bench/RESULTS.md, "DeepSeek-V3").
DeepSeek trained with 16-way pipeline and 64-way expert parallelism on 2048 H800s without tensor parallelism.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.family = "deepseek"  # MLA attention, DeepSeekMoE
    config.model.vocab_size = 129280  # DeepSeek-V3's tokenizer
    config.model.d_model = 7168  # hidden_size
    config.model.n_layers = 61  # num_hidden_layers
    config.model.n_heads = 128  # num_attention_heads; 16 per tensor shard
    config.model.q_lora_rank = 1536  # queries through a rank-1536 latent (q_a_proj, q_a_layernorm, q_b_proj)
    config.model.kv_lora_rank = 512  # the latent the KV cache holds
    config.model.qk_rope_head_dim = 64  # RoPE part of each query head and of the one shared key
    config.model.qk_nope_head_dim = 128  # position-free part of each query/key head
    config.model.v_head_dim = 128  # value width per head
    config.model.rope_interleave = True  # HF DeepSeek checkpoints' complex-pair order
    config.model.d_ff = 18432  # intermediate_size: the 3 dense layers' SwiGLU
    config.model.max_seq_len = 163840  # max_position_embeddings
    config.model.rope_theta = 10000.0  # RoPE base
    config.model.rope_scaling = "yarn"  # factor 40 over the 4096 pretraining context
    config.model.rope_factor = 40.0  # YaRN factor
    config.model.rope_original_max_len = 4096  # the pretraining context YaRN extends
    config.model.rope_beta_fast = 32.0  # YaRN's ramp: wavelengths above this many rotations kept
    config.model.rope_beta_slow = 1.0  # and below this many interpolated
    config.model.rope_mscale = 1.0  # YaRN mscale
    config.model.rope_mscale_all_dim = 1.0  # softmax scale times (0.1·ln 40 + 1)²
    config.model.norm_eps = 1e-6  # rms_norm_eps
    config.model.dtype = "bfloat16"  # bf16 matmuls; fp32 master params, softmax and loss

    config.moe = ml_collections.ConfigDict()
    config.moe.n_experts = 256  # n_routed_experts
    config.moe.top_k = 8  # num_experts_per_tok
    config.moe.d_ff = 2048  # moe_intermediate_size
    config.moe.shared_d_ff = 2048  # n_shared_experts 1 of moe_intermediate_size
    config.moe.dense_layers = (0, 1, 2)  # first_k_dense_replace = 3
    config.moe.scoring = "sigmoid"  # expert affinities by sigmoid
    config.moe.n_group = 8  # 256 experts in 8 groups of 32
    config.moe.topk_group = 4  # a token's experts come from its 4 best groups
    config.moe.norm_topk_prob = True  # gates renormalised over the chosen experts
    config.moe.routed_scale = 2.5  # routed_scaling_factor
    config.moe.correction_bias = True  # e_score_correction_bias: selection only
    config.moe.bias_update_rate = 0.001  # gamma (DeepSeek-V3 §4.2: 0.001 for the first 14.3T tokens)
    config.moe.aux_loss_coef = 0.0001  # the sequence-wise balance loss alpha, kept tiny

    config.parallel = ml_collections.ConfigDict()
    config.parallel.expert = 32  # 8 experts per rank
    config.parallel.tensor = 8  # one host's 8 GPUs
    config.parallel.sequence_parallel = True  # norms and residuals on sequence shards inside the tensor group
    config.parallel.zero = 0  # ZeRO shards over 'data', which is 1 here (refused otherwise)
    config.parallel.remat = "full"  # recompute each layer in the backward

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 256  # global sequences per step (a verify-sized step; DeepSeek ramped to 15360)
    config.train.seq_len = 4096  # tokens per sequence
    config.train.grad_accum = 8  # 1 sequence per expert rank per chunk
    config.train.steps = 100000  # placeholder schedule
    config.train.lr = 2.2e-4  # DeepSeek-V3's peak lr
    config.train.warmup_steps = 2000  # linear warmup

    config.data = ml_collections.ConfigDict()
    config.data.tokenizer = "bytes"  # placeholder: pass the path to DeepSeek-V3's tokenizer.json

    return config
