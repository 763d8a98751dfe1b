"""One file per parallelism: `tensor` (Megatron TP) and `sequence` (Megatron SP)."""
