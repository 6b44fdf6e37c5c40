"""``--chat-template-path`` through the real entry points on the tiny model: an RL run (``train.py`` under torchrun,
FSDP2 and an embedded engine, colocated on 2 ranks) generates from the prompts the file renders (the tokens of each
sample in ``--save-debug-rollout-data`` start with them), and an SFT run on chat messages (``train_async.py``,
Miles's SFT rollout, one rank) trains on the tokens the file's template gives the assistant turn. The template is
distinctive (``##USER## ...`` turns, ``[[BOT]] ... [[/BOT]]`` replies) where the tiny model's own is ChatML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _miles_e2e import check_ok, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}[[BOT]] {{ m['content'] }} [[/BOT]]\n"
            "{% else %}##{{ m['role'] | upper }}## {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}[[BOT]] {% endif %}")


@pytest.fixture
def template(tmp_path: Path) -> Path:
    p = tmp_path / "chat.jinja"
    p.write_text(TEMPLATE)
    return p


def test_rl_run_generates_from_the_files_prompts(tmp_path: Path, tiny_model_dir: Path, template: Path):
    from transformers import AutoTokenizer

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": [{"role": "user", "content": f"{i}+1="}], "label": str(i + 1)})
                            + "\n" for i in range(4)))
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--train-backend", "fsdp", "--colocate",
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2",
           "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "input",
           "--label-key", "label", "--rm-type", "math", "--apply-chat-template", "--chat-template-path", str(template),
           "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "3", "--lr", "1e-4", "--output-dir", str(out), "--no-progress",
           "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.jsonl")]
    check_ok(run(cmd, log, timeout=600), log)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [json.loads(line) for line in (out / "rollouts" / "rollout_0.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    prompts = sorted({tok.decode(r["tokens"][:len(r["tokens"]) - r["response_length"]]) for r in rows})
    assert prompts == [f"##USER## {i}+1=\n[[BOT]] " for i in range(4)], prompts
    assert [r["rollout_id"] for r in metrics(out)] == [0]


def test_sft_run_trains_on_the_files_assistant_tokens(tmp_path: Path, tiny_model_dir: Path, template: Path):
    data = tmp_path / "conversations.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{i % 5}+{i % 3}="},
                          {"role": "assistant", "content": str(i % 5 + i % 3)}]} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "1", "train_async.py", "--train-backend", "fsdp",
           "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "messages",
           "--chat-template-path", str(template), "--rollout-function-path",
           "miles.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
           "--disable-compute-advantages-and-returns", "--debug-train-only", "--num-epoch", "1",
           "--rollout-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-3", "--actor-num-nodes", "1",
           "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--output-dir", str(out), "--no-progress"]
    check_ok(run(cmd, log, timeout=420), log)
    recs = metrics(out)
    assert [r["rollout_id"] for r in recs] == [0, 1], recs
    # each trained span is "<sum> [[/BOT]]\n": the sums are 0..6, one character each, so 11 tokens of the
    # character-level tokenizer (the checkpoint's ChatML template gives "<sum><|im_end|>\n", 3 tokens)
    assert all(r["rollout/response_len"] == 11.0 for r in recs), recs
