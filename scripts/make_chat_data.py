"""Write recipes/data/arith_chat.jsonl: small chat data for the SFT and LoRA recipes (recipes/sft_tiny.yaml), and
recipes/data/arith_pairs.jsonl: preference pairs for the DPO recipe (recipes/dpo_tiny.yaml).

1,000 conversations in the `{"messages": [...]}` form `data.source = "chat"` reads: a user asks for a sum, a
difference or a product of numbers below 100 and the assistant answers in one fixed form ("23 + 45 = 68."); one in
eight starts with a system message. One exchange each: with the 515-id fixture tokenizer (which splits ChatML's tags
into several pieces) a conversation is 65–114 tokens, inside the fixture models' 128 positions. The form is learnt
in a few dozen steps by any model; the arithmetic itself is what a larger one gets right. Deterministic (seed 0):
rerunning rewrites the same file.

The pairs are TRL's standard preference rows, {"prompt", "chosen", "rejected"} as plain text (a pair is one row of
the batch, and two ChatML conversations of the fixture's tokenizer would not fit its 128 positions): a question, the
answer in the fixed form ("23 + 45 = 68."), and a rejected answer — half the time the right number in a chatty form
("Sure! It is 68."), half the time the fixed form with a wrong number (off by 1..9). A pair is 20–40 tokens.

    python scripts/make_chat_data.py
"""

import json
import pathlib
import random

OUT = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "data" / "arith_chat.jsonl"
PAIRS = OUT.with_name("arith_pairs.jsonl")
ASK = {"+": ["What is {a} + {b}?", "Add {a} and {b}.", "{a} plus {b}?"],
       "-": ["What is {a} - {b}?", "Subtract {b} from {a}.", "{a} minus {b}?"],
       "*": ["What is {a} * {b}?", "Multiply {a} by {b}.", "{a} times {b}?"]}
SYSTEM = ["You are a calculator.", "Answer briefly."]


def exchange(rng: random.Random) -> list[dict]:
    """One question and its answer."""
    op = rng.choice("+-*")
    a, b = rng.randrange(100), rng.randrange(100 if op != "*" else 13)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return [{"role": "user", "content": rng.choice(ASK[op]).format(a=a, b=b)},
            {"role": "assistant", "content": f"{a} {op} {b} = {value}."}]


def pair(rng: random.Random) -> dict:
    """One preference pair: a question, the fixed-form answer (chosen) and a chatty or wrong one (rejected)."""
    question, answer = (m["content"] for m in exchange(rng))
    value = int(answer.rsplit("= ", 1)[1].rstrip("."))
    if rng.random() < 0.5:
        rejected = f"Sure! It is {value}."
    else:
        rejected = answer.replace(f"= {value}.", f"= {value + rng.choice([-1, 1]) * rng.randrange(1, 10)}.")
    return {"prompt": question + " ", "chosen": answer, "rejected": rejected}


def main() -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(1000):
        messages = [{"role": "system", "content": rng.choice(SYSTEM)}] if rng.random() < 0.125 else []
        messages += exchange(rng)
        rows.append(json.dumps({"messages": messages}))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(rows) + "\n")
    print(f"wrote {len(rows)} conversations to {OUT}")
    rng = random.Random(1)
    PAIRS.write_text("\n".join(json.dumps(pair(rng)) for _ in range(1000)) + "\n")
    print(f"wrote 1000 preference pairs to {PAIRS}")


if __name__ == "__main__":
    main()
