"""Build everything the quickstart needs, locally (no hub): a tiny model, its tokenizer and the data.

    python examples/quickstart/build.py --out outputs/quickstart

The task: one-digit addition. A prompt is ``"a+b="`` (``a + b <= 9``, 55 problems) and the answer is one
digit followed by end-of-sequence. The reward (``--rm-type quickstart``) is 1 for the exact sum.

Written under ``--out``:
    model/        randomly initialised Qwen3-architecture causal LM (safetensors) + char-level tokenizer
    train.jsonl   GRPO prompts: {"input": "3+4=", "label": "7"}, every problem ``--train-copies`` times
    eval.jsonl    every problem once
    sft.jsonl     warm-start demonstrations from a *buggy teacher*: {"input", "label", "response"}; only
                  ``--sft-correct-fraction`` (20%) of them are right, the others are off by one (``a+b+1``).
                  SFT copies the bug (sampled reward ~0.2-0.4); GRPO against the verifier has to unlearn it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Model size chosen with prototype_grpo.py (see README.md): small enough for 2 CPU cores.
MODEL_KW = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10) if a + b <= 9]


def row(a: int, b: int) -> dict:
    return {"input": f"{a}+{b}=", "label": str(a + b)}


def train_rows(copies: int = 4, seed: int = 0) -> list[dict]:
    rows = [row(a, b) for _ in range(copies) for a, b in problems()]
    random.Random(seed).shuffle(rows)
    return rows


def eval_rows() -> list[dict]:
    return [row(a, b) for a, b in problems()]


def sft_rows(correct_fraction: float = 0.2, copies: int = 10, seed: int = 0, error: str = "off_by_one") -> list[dict]:
    """``copies`` demonstrations per problem, ``round(correct_fraction * copies)`` of them correct.

    ``error`` is how the teacher is wrong: ``off_by_one`` answers ``a+b+1`` (a systematic bug the
    student copies), ``random`` a uniformly drawn wrong digit.
    """
    if not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"--sft-correct-fraction must be in [0, 1], got {correct_fraction}.")
    rng = random.Random(seed)
    n_right = round(correct_fraction * copies)
    rows = []
    for a, b in problems():
        for i in range(copies):
            r = row(a, b)
            if i < n_right:
                answer = a + b
            elif error == "off_by_one":
                answer = a + b + 1
            else:
                answer = rng.choice([d for d in range(10) if d != a + b])
            rows.append({**r, "response": str(answer)})
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def build(out: Path, seed: int = 0, sft_correct_fraction: float = 0.2, sft_copies: int = 10,
          train_copies: int = 4) -> Path:
    from miles.utils.tiny_model import build_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    build_tiny_model(out / "model", seed=seed, **MODEL_KW)
    write_jsonl(out / "train.jsonl", train_rows(train_copies, seed))
    write_jsonl(out / "eval.jsonl", eval_rows())
    write_jsonl(out / "sft.jsonl", sft_rows(sft_correct_fraction, sft_copies, seed))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/quickstart"), help="Output directory.")
    p.add_argument("--seed", type=int, default=0, help="Model init and data shuffling seed.")
    p.add_argument("--sft-correct-fraction", type=float, default=0.2, help="Share of right SFT demonstrations.")
    p.add_argument("--sft-copies", type=int, default=10, help="SFT demonstrations per problem.")
    p.add_argument("--train-copies", type=int, default=4, help="Times each problem appears in train.jsonl.")
    a = p.parse_args()
    out = build(a.out, a.seed, a.sft_correct_fraction, a.sft_copies, a.train_copies)
    print(f"quickstart built in {out}: model/, train.jsonl, eval.jsonl, sft.jsonl")


if __name__ == "__main__":
    main()
