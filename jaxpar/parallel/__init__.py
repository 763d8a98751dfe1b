"""The mesh-axis table (`axes`), the plan built from it (`plan`), and one file per parallelism: `tensor` (Megatron
TP), `sequence` (Megatron SP), `pipeline` (the circular pipeline)."""
