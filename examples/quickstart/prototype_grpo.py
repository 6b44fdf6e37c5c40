"""Standalone prototype of the quickstart (plain PyTorch + HF, one process): SFT warm start, then GRPO.

It exists to pick the task, model size and hyper-parameters of ``examples/quickstart`` and to record
what they give, independently of the distributed system:

    OMP_NUM_THREADS=1 python examples/quickstart/prototype_grpo.py --seeds 0 1 2

GRPO here is the textbook form the real trainer implements: per prompt ``n`` samples at temperature
``T``; advantages are group-normalised rewards ``(r - mean) / (std + eps)``; PPO-clip loss over the
response tokens (the old policy is the sampling policy), averaged per sequence, one AdamW step per
rollout. The SFT warm start is cross-entropy on the response tokens (answer + eos).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402
from reward import quickstart_reward  # noqa: E402


def load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model, tok


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def sequence_logprobs(model, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Per-token log-probs of each sequence's response tokens (right-padded batch)."""
    max_len = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), max_len, dtype=torch.long)
    mask = torch.zeros(len(seqs), max_len, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return [logp[i, prompt_lens[i] - 1 : len(s) - 1] for i, s in enumerate(seqs)]


@torch.no_grad()
def sample(model, prompt_ids: list[list[int]], max_new: int, temperature: float, eos: int, gen: torch.Generator):
    """Batched sampling for equal-length prompts (the quickstart's prompts are fixed-length)."""
    assert len({len(p) for p in prompt_ids}) == 1, "prototype sampler wants equal-length prompts"
    ids = torch.tensor(prompt_ids)
    out = [[] for _ in prompt_ids]
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    past = None
    cur = ids
    for _ in range(max_new):
        o = model(input_ids=cur, past_key_values=past, use_cache=True)
        past = o.past_key_values
        logits = o.logits[:, -1].float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                if t == eos:
                    done[i] = True
        if done.all():
            break
        cur = nxt[:, None]
    return out


def sft(model, tok, rows: list[dict], steps: int, lr: float, batch: int, seed: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(rows), (batch,), generator=g).tolist()
        prompts = encode(tok, [rows[i]["input"] for i in idx])
        resps = encode(tok, [rows[i]["response"] for i in idx])
        seqs = [p + r + [tok.eos_token_id] for p, r in zip(prompts, resps)]
        lps = sequence_logprobs(model, seqs, [len(p) for p in prompts])
        loss = -torch.stack([lp.mean() for lp in lps]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], max_new: int, temperature: float, gen) -> float:
    prompts = encode(tok, [r["input"] for r in rows])
    outs = sample(model, prompts, max_new, temperature, tok.eos_token_id, gen)
    texts = tok.batch_decode(outs, skip_special_tokens=True)
    return sum(quickstart_reward(t, r["label"]) for t, r in zip(texts, rows)) / len(rows)


def grpo(model, tok, rows: list[dict], a: argparse.Namespace, seed: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(rows), generator=g).tolist()
    pos = 0
    rewards_per_rollout = []
    for _ in range(a.num_rollout):
        if pos + a.rollout_batch_size > len(order):
            order, pos = torch.randperm(len(rows), generator=g).tolist(), 0
        batch = [rows[i] for i in order[pos : pos + a.rollout_batch_size]]
        pos += a.rollout_batch_size
        prompts = encode(tok, [r["input"] for r in batch for _ in range(a.n_samples)])
        labels = [r["label"] for r in batch for _ in range(a.n_samples)]
        model.eval()
        outs = sample(model, prompts, a.max_response_len, a.temperature, tok.eos_token_id, g)
        model.train()
        texts = tok.batch_decode(outs, skip_special_tokens=True)
        rewards = torch.tensor([quickstart_reward(t, lab) for t, lab in zip(texts, labels)])
        rewards_per_rollout.append(rewards.mean().item())
        grouped = rewards.view(-1, a.n_samples)
        adv = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(-1)
        seqs = [p + o for p, o in zip(prompts, outs)]
        plens = [len(p) for p in prompts]
        with torch.no_grad():
            old = [lp.detach() for lp in sequence_logprobs(model, seqs, plens)]
        for _ in range(a.steps_per_rollout):
            new = sequence_logprobs(model, seqs, plens)
            losses = []
            for lp, olp, A in zip(new, old, adv.tolist()):
                ratio = torch.exp(lp - olp)
                pg = -torch.minimum(ratio * A, ratio.clamp(1 - 0.2, 1 + 0.2) * A)
                losses.append(pg.mean())
            loss = torch.stack(losses).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return rewards_per_rollout


def run_seed(a: argparse.Namespace, seed: int) -> dict:
    from miles.utils.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        build_tiny_model(d, hidden_size=a.hidden, num_layers=a.layers, num_heads=4, num_kv_heads=2, seed=seed)
        model, tok = load_model(Path(d))
    torch.manual_seed(seed)
    t0 = time.time()
    sft(model, tok, build.sft_rows(a.sft_correct_fraction, a.sft_copies, seed, a.sft_error), a.sft_steps, a.sft_lr, a.sft_batch, seed)
    t_sft = time.time() - t0
    g = torch.Generator().manual_seed(seed + 1000)
    model.eval()
    warm_sampled = evaluate(model, tok, build.eval_rows(), a.max_response_len, a.temperature, g)
    warm_greedy = evaluate(model, tok, build.eval_rows(), a.max_response_len, 0.0, g)
    t1 = time.time()
    curve = grpo(model, tok, build.train_rows(4, seed), a, seed)
    t_grpo = time.time() - t1
    model.eval()
    end_sampled = evaluate(model, tok, build.eval_rows(), a.max_response_len, a.temperature, g)
    end_greedy = evaluate(model, tok, build.eval_rows(), a.max_response_len, 0.0, g)
    first3, last3 = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    return {
        "seed": seed, "sft_s": round(t_sft, 1), "grpo_s": round(t_grpo, 1),
        "warm_eval_sampled": round(warm_sampled, 3), "warm_eval_greedy": round(warm_greedy, 3),
        "end_eval_sampled": round(end_sampled, 3), "end_eval_greedy": round(end_greedy, 3),
        "first3": round(first3, 3), "last3": round(last3, 3),
        "passed": last3 - first3 >= 0.3 and last3 >= 0.8,
        "curve": [round(x, 2) for x in curve],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-correct-fraction", type=float, default=0.2)
    p.add_argument("--sft-copies", type=int, default=10)
    p.add_argument("--sft-error", choices=["off_by_one", "random"], default="off_by_one")
    p.add_argument("--num-rollout", type=int, default=30)
    p.add_argument("--rollout-batch-size", type=int, default=16)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps-per-rollout", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for s in a.seeds:
        r = run_seed(a, s)
        results.append(r)
        print(json.dumps(r), flush=True)
    ok = sum(r["passed"] for r in results)
    print(f"passed {ok}/{len(results)}; mean GRPO seconds {sum(r['grpo_s'] for r in results) / len(results):.1f}", flush=True)


if __name__ == "__main__":
    main()
