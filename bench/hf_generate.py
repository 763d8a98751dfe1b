"""The Hugging Face side of `bench/serve.py --versus-hf`: transformers' own `generate` on the exported model, run in
a Python that has torch and transformers (jaxpar's environment does not need them).

    python bench/hf_generate.py --model HF_DIR --requests REQUESTS.json --batch 16 --out RESULT.json

REQUESTS.json: [[prompt ids, output length], ...] in arrival order. The requests run as `generate` runs a batch:
`--batch` consecutive requests at a time, left-padded, greedy, eos off, each batch to its longest output length
(`min_new_tokens = max_new_tokens`), so every request's first `length` new tokens are its output and the rest of
its row is the batch's wait — static batching, as transformers' `generate` does it. One warm-up batch first.
Writes {"wall_s", "output_tokens_per_s", "tokens": [each request's new tokens], versions, threads}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    requests = json.loads(open(args.requests).read())

    def run(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(o for _, o in batch)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return [out[i, width:width + o].tolist() for i, (_, o) in enumerate(batch)]

    run(requests[:args.batch])  # warm up
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(requests), args.batch):
        tokens += run(requests[i:i + args.batch])
    wall = time.perf_counter() - start
    result = {"wall_s": wall, "output_tokens_per_s": sum(len(t) for t in tokens) / wall, "tokens": tokens,
              "batch": args.batch, "torch": torch.__version__, "transformers": transformers.__version__,
              "threads": torch.get_num_threads()}
    open(args.out, "w").write(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
