"""Image SFT as Miles's geo3k VLM SFT launcher (examples/geo3k_vlm/run_geo3k_vlm_sft.sh) runs it: the SFT-path
flags of tests/fixtures/miles_scripts/sft_async_geo3k_vlm.flags (``--multimodal-keys {"image": "images"}``,
``miles.rollout.sft_rollout.generate_rollout``, ``--loss-type sft_loss``, ``--debug-train-only``) through
``train_async.py`` on a tiny Qwen3-VL (miles.utils.tiny_vlm), two ranks, on the FSDP backend and on the fixture's
own Megatron backend (its Megatron flags too: TP 2 instead of 4, ``--sequence-parallel``, full recompute;
miles/trainer/megatron/vlm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _miles_e2e import REPO, check_ok, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]

FIXTURE = REPO / "tests" / "fixtures" / "miles_scripts" / "sft_async_geo3k_vlm.flags"
SFT_PATH_FLAGS = {  # what the SFT run path reads; sizes are overridden below for the tiny run
    "--multimodal-keys", "--hf-checkpoint", "--rollout-function-path", "--prompt-data", "--input-key",
    "--apply-chat-template", "--rollout-shuffle", "--num-epoch", "--rollout-batch-size", "--global-batch-size",
    "--loss-type", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only",
    "--optimizer", "--lr", "--weight-decay", "--adam-beta1", "--adam-beta2", "--use-dynamic-batch-size",
    "--max-tokens-per-gpu",
}


MEGATRON_FLAGS = {  # the fixture's Megatron flags (its TP 4 becomes 2 below: two ranks)
    "--train-backend", "--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
    "--context-parallel-size", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--attention-dropout",
    "--hidden-dropout", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend",
    "--megatron-to-hf-mode",
}


def _fixture_flags(model: Path, data: Path, out: Path, names: set[str] = SFT_PATH_FLAGS) -> list[str]:
    argv = []
    for line in FIXTURE.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if line.startswith("--") and name in names:
            rest = rest.replace("{MODEL}", str(model)).replace("{DATA}", str(data)).replace("{OUT}", str(out))
            argv += [name] + ([rest] if rest.startswith("{") else rest.split())
    assert names is not SFT_PATH_FLAGS or "--multimodal-keys" in argv and '{"image": "images"}' in argv
    return argv


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_vlm_sft_with_miles_launcher_flags(tmp_path: Path, backend: str):
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import load_file

    from miles.utils.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "model")
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(8):  # geo3k's shape: a question with one <image>, the answer as the assistant turn
        Image.fromarray((np.random.default_rng(i).random((32 + 16 * (i % 2), 48, 3)) * 255).astype("uint8")).save(
            tmp_path / "img" / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": f"<image>Find x. ({i % 3})"},
                                  {"role": "assistant", "content": f"x = {i % 3}"}], "images": [f"img/{i}.png"]})
    data = tmp_path / "geo.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, log = tmp_path / "run", tmp_path / "run.log"
    backend_flags = ["--train-backend", "fsdp"] if backend == "fsdp" else [
        *_fixture_flags(model, data, tmp_path, MEGATRON_FLAGS), "--tensor-model-parallel-size", "2"]
    assert backend == "fsdp" or "--sequence-parallel" in backend_flags and "megatron" in backend_flags
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "train_async.py", *backend_flags,
           *_fixture_flags(model, data, tmp_path),
           "--rollout-batch-size", "4", "--global-batch-size", "4", "--num-epoch", "1", "--lr", "1e-3",
           "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2",
           "--output-dir", str(out), "--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "hf"),
           "--no-progress"]
    check_ok(run(cmd, log, timeout=480), log)
    recs = metrics(out)
    assert [r["rollout_id"] for r in recs] == [0, 1], recs   # 8 rows, 4 per rollout, --num-epoch 1
    # each response is "x = N<|im_end|>\n": 7 trained tokens; the image tokens are in the prompt
    assert all(r["rollout/response_len"] == 7.0 and r["train/num_samples"] == 4 for r in recs), recs
    assert recs[1]["train/sft_loss"] < recs[0]["train/sft_loss"], recs
    before, after = load_file(str(model / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    visual = [k for k in before if k.startswith("model.visual.")]
    assert visual and all(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in visual)  # ViT trained
    from transformers import Qwen3VLForConditionalGeneration

    loaded = Qwen3VLForConditionalGeneration.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    for k, t in after.items():                    # transformers loads the --save-hf output to exactly its tensors
        assert torch.equal(loaded[k], t.float()), k
    if backend != "megatron":
        return
    # the torch_dist checkpoint holds the trained vision tower as --save-hf wrote it, and resumes (--load)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "ckpt" / "iter_0000001"), str(tmp_path / "ckpt.pt"))
    saved = torch.load(str(tmp_path / "ckpt.pt"), weights_only=False)
    vision = {k: v for k, v in saved.items() if k.startswith("vision.")}
    assert len(vision) == len(visual) and all(torch.equal(v.float(), after["model.visual." + k[len("vision."):]].float())
                                              for k, v in vision.items())
    log2 = tmp_path / "run2.log"
    cmd2 = cmd + ["--num-epoch", "2", "--output-dir", str(tmp_path / "run2"), "--save-hf", str(tmp_path / "hf2"),
                  "--load", str(tmp_path / "ckpt")]                  # the last value of a flag wins
    check_ok(run(cmd2, log2, timeout=480), log2)
    assert [r["rollout_id"] for r in metrics(tmp_path / "run2")] == [2, 3]
