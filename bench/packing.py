"""Packing on chat data: the same conversations one a row (padded) and best-fit packed several a row
(`data.pack`), trained side by side in one process — the share of real tokens in the rows' slots, the step time,
the slots and the real tokens per second, and the loss on the assistant's tokens.

The data is recipes/data/arith_chat.jsonl (1,000 conversations of 65–114 tokens with the llama fixture's tokenizer
and ChatML template); the model is configs/tiny.py's shape with that tokenizer's 515 ids, rows of 512 tokens,
batch 8, at (data, tensor) = (4, 2) on 8 simulated devices. Both runs take the same steps; the packed one sees
about five times the conversations per step.

    PYTHONPATH=. python bench/packing.py [STEPS]      # STEPS 30: ~2 min on 2 CPU cores
"""
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.loop import fit  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
print("| rows | packing (real/slots) | step s | slots/s | real tokens/s | scored/step | loss, first → last |")
print("|---|---|---|---|---|---|---|")
with tempfile.TemporaryDirectory() as tmp:
    for pack in (False, True):
        config = load_config(str(ROOT / "configs" / "tiny.py"), [
            "data.source=chat", f"data.path={ROOT / 'recipes/data/arith_chat.jsonl'}",
            f"data.tokenizer={ROOT / 'tests/fixtures/hf/llama/tokenizer.json'}", f"data.pack={str(pack).lower()}",
            "model.vocab_size=515", "model.max_seq_len=512", "train.seq_len=512", "train.batch_size=8",
            f"train.steps={steps}", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=5",
            "parallel.data=4", "parallel.tensor=2", "parallel.pipe=1", "parallel.repeats=1",
            "parallel.microbatches=1"])
        history = fit(config, pathlib.Path(tmp) / str(pack), progress=False).history
        timed = [h for h in history if h["step"] > 3]  # past the compile
        dt = float(np.median([h["step_time_s"] for h in timed]))
        packing = float(np.mean([h["packing"] for h in history]))
        slots = config.train.batch_size * config.train.seq_len / dt
        print(f"| {'packed' if pack else 'one a row'} | {packing:.3f} | {dt:.3f} | {slots:,.0f} | "
              f"{slots * packing:,.0f} | {np.mean([h['targets'] for h in history]):.0f} | "
              f"{history[0]['loss']:.2f} → {history[-1]['loss']:.2f} |", flush=True)
