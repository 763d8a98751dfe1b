"""Memory of a LoRA and a QLoRA fine-tune against the full one, from the compiled training step: the step's
argument bytes per device (the state it is handed — weights, optimizer moments — and the batch) and its
temporaries (`compiled.memory_analysis()`), and the optimizer state's bytes per device from the state itself.

The llama fixture's shape (tests/fixtures/hf/llama: 2 layers, d 64, vocab 515) as recipes/sft_tiny.yaml and
recipes/lora_tiny.yaml run it — (data, pipe, tensor) = (2, 2, 2) SP, batch 16 of 128 — on 8 simulated devices:
full fine-tuning, LoRA r = 8 on all seven matrices (and with LoRA dropout 0.1: the masks are recomputed from
the tokens' coordinates, never stored), and the same over int8 weights. Nothing is trained: the steps
are compiled from abstract states.

    PYTHONPATH=. python bench/lora.py
"""
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.interop import hf  # noqa: E402
from jaxpar.train import build_trainer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.chdir(ROOT)
runs = {"full fine-tune": ("recipes/sft_tiny.yaml", []),
        "LoRA r=8": ("recipes/lora_tiny.yaml", []),
        "LoRA r=8, dropout 0.1": ("recipes/lora_tiny.yaml", ["lora.dropout=0.1"]),
        "QLoRA r=8 (int8 base)": ("recipes/lora_tiny.yaml", ["model.weights=int8"])}
print("| run | weights / device | optimizer state / device | step arguments / device | step temporaries |")
print("|---|---|---|---|---|")
for name, (recipe, overrides) in runs.items():
    config = hf.init_config(load_config(recipe, overrides), ROOT / "tests/fixtures/hf/llama")
    trainer = build_trainer(config, jax.devices(), abstract=True)
    state = trainer.state

    def per_device(tree) -> int:  # bytes one device holds of each array (its shard)
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
                   if hasattr(x, "sharding"))

    batch = trainer.random_batch(config)
    batch = {"tokens": batch, "mask": batch, "segments": batch}
    memory = trainer.train_step.lower(state, batch).compile().memory_analysis()
    print(f"| {name} | {per_device(state.params):,} | {per_device(state.opt_state):,} | "
          f"{memory.argument_size_in_bytes:,} | {memory.temp_size_in_bytes:,} |", flush=True)
