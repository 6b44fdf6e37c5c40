"""The MoE families of the routing-replay tests beyond Qwen3-MoE (GLM-4.5, gpt-oss, GLM-5 / DSA, DeepSeek-V4): their
tiny checkpoints, the Megatron flags their parity tests use, and a copy of a checkpoint whose routers choose other
experts. Shared by ``tests/unit/trainer/megatron/test_routing_replay_families.py`` and
``tests/multiprocess/test_routing_replay_family_layouts.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

ET1 = ["--expert-tensor-parallel-size", "1", "--moe-aux-loss-coeff", "0", "--moe-router-dtype", "fp32"]
SIGMOID = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-bias-update-rate", "0"]
PROMPTS = [[5, 9, 13, 2, 7, 30], [40, 41, 8], [11, 12, 13, 14, 15, 16, 17]]
ROUTER_PARAM = re.compile(r"(?:mlp|ffn)\.(?:gate|router)\.(?:weight|bias|e_score_correction_bias)$")


def _glm45(d: Path) -> Path:
    from miles.utils.tiny_glm4_moe import build_tiny_glm4_moe

    return build_tiny_glm4_moe(d, n_routed_experts=8, n_group=2, topk_group=1)


def _gpt_oss(d: Path) -> Path:
    from miles.utils.tiny_gpt_oss import build_tiny_gpt_oss_model

    return build_tiny_gpt_oss_model(d, num_experts=8)


def _glm5(d: Path) -> Path:
    from miles.utils.tiny_dsa import build_tiny_dsa_model

    return build_tiny_dsa_model(d, n_routed_experts=8)


def _dsv4(d: Path) -> Path:
    from miles.utils.tiny_dsv4 import build_tiny_dsv4_model

    return build_tiny_dsv4_model(d, n_routed_experts=8)


FAMILIES = {  # name: (tiny builder, the Megatron flags its multiprocess parity tests use)
    "glm4_moe": (_glm45, ET1 + SIGMOID),
    "gpt_oss": (_gpt_oss, ET1 + ["--softmax-type", "learnable", "--window-size", "4,0", "--window-attn-skip-freq", "2"]),
    "glm_moe_dsa": (_glm5, ET1 + SIGMOID + ["--multi-latent-attention"]),
    "deepseek_v4": (_dsv4, ET1 + ["--moe-router-score-function", "sqrtsoftplus", "--moe-router-enable-expert-bias",
                                  "--moe-router-topk-scaling-factor", "1.5"]),
}


def perturbed(base: Path, out: Path) -> Path:
    """A copy of ``base`` whose routers choose differently: each router's rows (weight, bias, correction bias) and
    hash table shifted by one expert, plus a little noise."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    gen = torch.Generator().manual_seed(5)
    moved = 0
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
            continue
        sd = load_file(str(f))
        for k, v in sd.items():
            if ROUTER_PARAM.search(k) and v.is_floating_point():      # expert e scored as expert e + 1 was
                sd[k] = v.roll(1, 0) + torch.randn(v.shape, generator=gen) * 0.05
                moved += 1
            elif k.endswith("gate.tid2eid"):
                sd[k] = (v + 1) % int(v.max() + 1)
                moved += 1
        save_file(sd, str(out / f.name), metadata={"format": "pt"})
    assert moved, "no router tensor found to perturb"
    return out
