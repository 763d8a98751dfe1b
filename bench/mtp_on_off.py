"""Multi-token prediction on deepseek_tiny: the training loss with MTP on (model.mtp_depth 1, λ = train.mtp_loss_weight
0.3) and off at equal steps (same seed, same data order; the MTP parameters are drawn after the others, so both runs
start from the same main model), then the MTP draft's acceptance in self-speculative greedy decoding
(jaxpar.infer.speculative) with the tokens checked equal to plain greedy decoding's.

One device (data = expert = tensor = 1), batch 16, STEPS steps; the prompts are the first 40 bytes of lines of the
standard library's json/decoder.py (comments and blank lines dropped), 48 new tokens each.

    PYTHONPATH=. python bench/mtp_on_off.py [STEPS] [WORKDIR]     # STEPS 300: ~15 min per run on 2 busy CPU cores
"""
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.infer.decode import generate  # noqa: E402
from jaxpar.infer.speculative import speculative_generate  # noqa: E402
from jaxpar.train.loop import fit  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
root = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/mtp_on_off")
source = pathlib.Path(json.__file__).parent / "decoder.py"
lines = [s for s in (line.strip() for line in source.read_text().splitlines()) if s and not s.startswith("#")]
prompts = [list(s.encode())[:40] for s in lines[40:] if len(s) > 40][:4]
curves = {}
for depth in (0, 1):
    config = load_config("configs/deepseek_tiny.py", [
        f"train.steps={steps}", "train.batch_size=16", "train.log_every=10", f"train.eval_every={steps}",
        "train.eval_batches=2", "train.warmup_steps=20", "parallel.data=1", "parallel.expert=1",
        "parallel.tensor=1", f"model.mtp_depth={depth}"])
    result = fit(config, root / f"mtp{depth}", devices=jax.devices()[:1], progress=False)
    curves[depth] = {int(r["step"]): (float(r["loss"]), r.get("mtp_loss"), r.get("eval_loss"))
                     for r in result.history if "loss" in r}
    if depth:
        model = nnx.merge(result.graphdef, result.state.params)
        want = generate(model, prompts, max_new_tokens=48, return_prompt=False)
        got, info = speculative_generate(model, prompts, max_new_tokens=48)
        print("speculative tokens identical to greedy:", bool(np.array_equal(got, want)), json.dumps(info))
print("step  loss(off)  loss(on)  mtp_loss(on)  eval(off)  eval(on)")
for step in sorted(curves[1]):
    if step % 50 == 0 or step == 1:
        off, on = curves[0][step], curves[1][step]
        print(step, f"{off[0]:.4f}", f"{on[0]:.4f}", f"{float(on[1]):.4f}", off[2], on[2])
