"""On-policy distillation with Miles's flags (examples/on_policy_distillation of Miles v0.1.0): the teacher at
--rm-url, scored by miles.rollout.on_policy_distillation.reward_func and turned into teacher log-probs by its
post_process_rewards; train.py with 1 trainer rank + 1 student engine, a separate embedded teacher engine
with other weights (same tokenizer), so the reverse KL folded into the advantages is not zero."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from _miles_e2e import check_ok, metrics, run

from miles.fleet.client import EngineControl
from miles.fleet.engines import build_engine_argv, engine_url
from miles.spmd.supervisor import EngineSupervisor
from miles.utils.net import find_free_port
from miles.utils.tiny_model import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_opd_with_miles_reward_func_and_post_process(tmp_path: Path, tiny_model_dir: Path):
    teacher_dir = build_tiny_model(tmp_path / "teacher", hidden_size=64, num_layers=2, seed=7)
    port = find_free_port()
    argv = build_engine_argv("embedded", hf_checkpoint=str(teacher_dir), host="127.0.0.1", port=port,
                             api_key=None, device="cpu", max_running_requests=16, max_context_len=64)
    sup = EngineSupervisor(argv, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, name="teacher",
                           log_path=tmp_path / "teacher.log", max_restarts=0).start()
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    try:
        async def up():
            async with EngineControl(engine_url("127.0.0.1", port)) as ctl:
                await ctl.wait_healthy(180, alive=lambda: sup.alive)
        asyncio.run(up())
        out, log = tmp_path / "run", tmp_path / "run.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
               "--train-backend", "fsdp", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
               "--num-gpus-per-node", "2", "--hf-checkpoint", str(tiny_model_dir),
               "--prompt-data", str(data), "--input-key", "prompt", "--rollout-shuffle", "--num-rollout", "2",
               "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
               "--rollout-temperature", "1", "--global-batch-size", "4", "--lr", "1e-4",
               "--advantage-estimator", "grpo", "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0",
               "--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func",
               "--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards",
               "--rm-url", f"{engine_url('127.0.0.1', port)}/generate",
               "--output-dir", str(out), "--no-progress"]
        check_ok(run(cmd, log, timeout=420), log)
    finally:
        sup.stop()
    recs = metrics(out)
    assert [r["rollout_id"] for r in recs] == [0, 1], recs
    assert all(r["rollout/raw_reward"] == 0.0 for r in recs), recs  # pure distillation: task reward 0
    kl = [r[k] for r in recs for k in r if "opd" in k]
    assert kl and all(v != 0 for v in kl), recs  # another teacher: the reverse KL is not zero
