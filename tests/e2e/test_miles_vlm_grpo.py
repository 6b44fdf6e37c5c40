"""GRPO on images as Miles's geo3k VLM launcher (examples/geo3k_vlm/run_geo3k_vlm.sh) runs it: the RL-path flags of
tests/fixtures/miles_scripts/grpo_geo3k_vlm.flags (``--multimodal-keys {"image": "images"}``, geo3k's ``problem`` /
``answer`` columns, ``--rm-type math``, the geo3k generate plugin, GRPO with ``--eps-clip 0.2 --eps-clip-high 0.28``,
``--kl-loss-type low_var_kl``, evaluation on an image set, ``--colocate``) through ``train.py`` on a tiny Qwen3-VL
(miles.utils.tiny_vlm), 2 ranks each training and hosting an embedded engine, 2 rollouts, on the fixture's own
Megatron backend (its Megatron flags, TP 2 instead of 4) and on the script's FSDP variant (grpo_geo3k_vlm_fsdp.flags,
without its GPU-only attention kernels).

The engines get the images as SGLang's ``image_data``: their log-probs of the generated tokens agree with the
trainer's, which recomputes them with the images (``train/train_rollout_logprob_abs_diff``, measured 2e-7; without
the images this model's log-probs move by up to 9e-2, tests/multiprocess/test_vlm_grpo.py, and an engine refuses
image tokens without ``image_data``), also after the weight update, and the trained vision tower reaches
``--save-hf``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _miles_e2e import REPO, check_ok, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

FIXTURES = REPO / "tests" / "fixtures" / "miles_scripts"
PLUGINS = FIXTURES / "plugins"
RL_PATH_FLAGS = {  # what the RL run path reads; sizes are overridden below for the tiny run
    "--actor-num-nodes", "--multimodal-keys", "--hf-checkpoint", "--prompt-data", "--input-key", "--label-key",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "--custom-generate-function-path", "--num-rollout",
    "--rollout-batch-size", "--n-samples-per-prompt", "--rollout-max-response-len", "--rollout-temperature",
    "--global-batch-size", "--eval-interval", "--eval-prompt-data", "--n-samples-per-eval-prompt",
    "--eval-max-response-len", "--advantage-estimator", "--kl-loss-coef", "--kl-loss-type", "--kl-coef",
    "--entropy-coef", "--eps-clip", "--eps-clip-high", "--optimizer", "--lr", "--lr-decay-style", "--weight-decay",
    "--adam-beta1", "--adam-beta2", "--rollout-num-gpus-per-engine", "--colocate",
}
BACKEND_FLAGS = {  # the fixtures' backend blocks (Megatron: TP 4 becomes 2 below, two ranks)
    "megatron": {"--train-backend", "--tensor-model-parallel-size", "--sequence-parallel",
                 "--pipeline-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
                 "--expert-tensor-parallel-size", "--recompute-granularity", "--recompute-method",
                 "--recompute-num-layers", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "--attention-dropout",
                 "--hidden-dropout", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
                 "--attention-backend", "--megatron-to-hf-mode"},
    # fa3 / flash_attention_3 (--sglang-attention-backend, --attn-implementation) are CUDA kernels: left out on CPU
    "fsdp": {"--train-backend", "--gradient-checkpointing", "--update-weight-buffer-size"},
}


def _fixture_flags(path: Path, names: set[str], subs: dict[str, str]) -> list[str]:
    argv = []
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if line.startswith("--") and name in names:
            for key, value in subs.items():
                rest = rest.replace("{" + key + "}", value)
            argv += [name] + ([rest] if rest.startswith("{") else rest.split())
    return argv


def _data(root: Path) -> Path:
    """geo3k_imgurl's columns: a problem with one <image>, its answer, the image (sizes differ: grids differ)."""
    import numpy as np
    from PIL import Image

    (root / "img").mkdir(parents=True)
    rows = []
    for i in range(8):
        Image.fromarray((np.random.default_rng(i).random((32 + 16 * (i % 3), 48, 3)) * 255).astype("uint8")).save(
            root / "img" / f"{i}.png")
        rows.append({"problem": f"<image>Find x. ({i % 3})", "answer": str(i % 3), "images": [f"img/{i}.png"]})
    path = root / "geo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_vlm_grpo_with_miles_launcher_flags(tmp_path: Path, backend: str):
    import torch
    from safetensors.torch import load_file

    from miles.utils.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "model", tie_word_embeddings=backend == "fsdp")
    data = _data(tmp_path / "data")
    fixture = FIXTURES / ("grpo_geo3k_vlm.flags" if backend == "megatron" else "grpo_geo3k_vlm_fsdp.flags")
    subs = {"MODEL": str(model), "DATA": str(data), "OUT": str(tmp_path)}
    flags = _fixture_flags(fixture, RL_PATH_FLAGS | BACKEND_FLAGS[backend], subs)
    assert "--colocate" in flags and '{"image": "images"}' in flags and "examples.geo3k_vlm.rollout.generate" in flags
    assert ("--sequence-parallel" in flags) == (backend == "megatron")
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", *flags,
           *(["--tensor-model-parallel-size", "2"] if backend == "megatron" else []),
           "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
           "--rollout-max-response-len", "8", "--eval-max-response-len", "8", "--lr", "1e-3",
           "--entropy-coef", "0.01",   # a random tiny model earns no reward: the entropy term gives the step a gradient
           "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2", "--output-dir", str(out),
           "--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "hf"), "--no-progress"]
    # Miles's scripts run from its repository root: examples.geo3k_vlm.rollout is the fixture's stand-in
    check_ok(run(cmd, log, timeout=780, PYTHONPATH=os.pathsep.join([str(PLUGINS), str(REPO)])), log)
    recs = metrics(out)
    assert [r["rollout_id"] for r in recs] == [0, 1], recs
    for r in recs:
        assert r["rollout/num_samples"] == 8 and r["rollout/response_len"] > 0, r
        assert 0.0 <= r["rollout/raw_reward"] <= 1.0, r               # --rm-type math against --label-key answer
        # the engines saw the images, and after rollout 0's update the trained vision tower (measured: 2.2e-7)
        assert r["train/train_rollout_logprob_abs_diff"] < 4.5e-7 and r["train/grad_norm"] > 0, r
    assert "eval/geo3k_imgurl" in recs[-1], recs[-1]                   # evaluation on images (the last rollout)
    before, after = load_file(str(model / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    visual = [k for k in before if k.startswith("model.visual.")]
    assert visual and sorted(before) == sorted(after)
    assert all(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in visual)    # the ViT is trained
