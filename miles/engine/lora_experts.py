"""LoRA adapters on MoE experts, as the embedded engine serves them (``miles.engine.lora``).

transformers keeps a layer's routed experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H] gate rows then up rows,
``down_proj`` [E, H, I]: qwen3_moe, qwen3_5_moe, glm4_moe; gpt-oss: [E, H, 2I] with gate and up interleaved column by
column, [E, I, H], and biases), so no per-expert linear exists to hook. An adapter names each expert's linears as
PEFT does and as the trainers send them (``...mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` with
``lora_A`` [r, in] and ``lora_B`` [out, r]; ``miles.trainer.lora.peft_tensors`` / ``lora_hf.peft_tensors``).

Each experts module an adapter covers gets its forward replaced (while some adapter covers it) by ``forward``:
transformers' eager loop over the hit experts, each expert's tokens through ``down(gate_fn(gate_up x))`` (the
module's own ``_apply_gate``, biases when it has them), weighted and summed, with, for the tokens of a request of
adapter ``a``, ``B_a,e (A_a,e x)`` added to the expert's gate/up output and to its down output (fp32, scaled). A
forward with no adapter token runs the module's own forward (the configured experts kernel). gate and up with the
same ``A`` (the trainers': Megatron's one ``linear_fc1``) share one ``A x``.

Shared-outer (``--experts-shared-outer-loras``, SGLang's ``experts_shared_outer_loras``; the trainer's
``--experts-shared-outer-loras``): the outer factors, gate/up's ``A`` [r, H] and down's ``B`` [H, r], are one per
layer shared by every expert, the inner ones per expert. The trainers still send them under every expert's name;
with the flag on, a load checks they are indeed shared (one line naming the tensor otherwise) and keeps one copy,
and gate/up's ``A x`` is computed once per adapter for all its tokens. Without the flag such an adapter is served as
per-expert (the same sums). SGLang's ``--lora-use-virtual-experts`` picks how its fused MoE kernel lays out the
adapters (a kernel path); this loop computes the same sums either way, so it changes nothing here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

EXPERT_KEY = re.compile(r"^(?P<parent>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The model's transformers fused-experts modules (3-D ``gate_up_proj`` and ``down_proj``) by name."""
    out = {}
    for name, m in model.named_modules():
        gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3:
            out[name] = m
    return out


@dataclass
class ExpertAdapter:
    """One adapter on one experts module: fp32, ``B`` scaled; None for a target the adapter lacks. ``a1`` [E, R1, H]
    (gate/up's ``A`` stacked, R1 = r or 2 r), ``b1`` [E, 2I, R1] (rows in the fused tensor's output order), ``a2``
    [E, r, I], ``b2`` [E, H, r]; ``shared``: a1 / b2 are [1, ...] (one per layer)."""
    a1: torch.Tensor | None
    b1: torch.Tensor | None
    a2: torch.Tensor | None
    b2: torch.Tensor | None
    shared: bool


def _layout(m: nn.Module) -> tuple[bool, bool, bool]:
    """(transposed, concatenated, bias) of a fused-experts module; anything else is refused."""
    transposed, concatenated = bool(getattr(m, "is_transposed", False)), bool(getattr(m, "is_concatenated", True))
    if not getattr(m, "has_gate", True) or getattr(m, "has_post_expert_norm", False) or not hasattr(m, "_apply_gate"):
        raise ValueError(f"{type(m).__name__} (no gate/up pair, or a post-expert norm)")
    return transposed, concatenated, bool(getattr(m, "has_bias", False))


def build(parent: str, m: nn.Module, halves: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
          scale: float, shared_outer: bool, device: torch.device, error: Callable[[str], Exception]) -> ExpertAdapter:
    """Check one experts module's per-expert pairs ``(e, proj) -> (A, B)`` against its fused tensors and stack them."""
    try:
        transposed, concatenated, _ = _layout(m)
    except ValueError as e:
        raise error(f"adapter modules under {parent!r}: the experts of {e} take no adapters here") from None
    E = m.gate_up_proj.shape[0]
    H, two_i = ((m.gate_up_proj.shape[1], m.gate_up_proj.shape[2]) if transposed
                else (m.gate_up_proj.shape[2], m.gate_up_proj.shape[1]))
    inter = two_i // 2
    shapes = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
    rank = None
    for (e, proj), (a, b) in sorted(halves.items()):
        out_f, in_f = shapes[proj]
        where = f"{parent}.{e}.{proj}"
        if e >= E:
            raise error(f"adapter module {where!r}: the layer has {E} experts")
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or b.shape[1] != a.shape[0]:
            raise error(f"adapter module {where!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the "
                        f"expert's linear [{out_f}, {in_f}] (A [r, in], B [out, r])")
        if rank is not None and a.shape[0] != rank:
            raise error(f"adapter module {where!r} has rank {a.shape[0]}, another expert's has {rank}")
        rank = a.shape[0]
    r = rank
    f32 = dict(dtype=torch.float32, device=device)

    def get(e: int, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        ab = halves.get((e, proj))
        return None if ab is None else (ab[0].to(**f32), ab[1].to(**f32) * scale)

    if shared_outer:      # the contract: one gate/up A and one down B per layer, whatever expert names them
        for proj, which, what in (("gate_proj", 0, "lora_A"), ("up_proj", 0, "lora_A"), ("down_proj", 1, "lora_B")):
            got = [(e, ab[which]) for (e, p), ab in sorted(halves.items()) if p == proj]
            for e, t in got[1:]:
                if not torch.equal(t, got[0][1]):
                    raise error(f"adapter module {parent}.{e}.{proj}: its {what} differs from expert {got[0][0]}'s, "
                                "but --experts-shared-outer-loras serves one gate/up lora_A and one down lora_B per "
                                "layer shared by all experts; drop --sglang-experts-shared-outer-loras for per-expert "
                                "adapters")
    fc1 = any(p in ("gate_proj", "up_proj") for _, p in halves)
    fc2 = any(p == "down_proj" for _, p in halves)
    one_a = all(torch.equal(halves[(e, "gate_proj")][0], halves[(e, "up_proj")][0]) for e in range(E)
                if (e, "gate_proj") in halves and (e, "up_proj") in halves)
    a1 = b1 = a2 = b2 = None
    if fc1:
        r1 = r if one_a else 2 * r
        a1 = torch.zeros(E, r1, H, **f32)
        b1 = torch.zeros(E, two_i, r1, **f32)
        rows = {"gate_proj": slice(0, inter) if concatenated else slice(0, two_i, 2),
                "up_proj": slice(inter, two_i) if concatenated else slice(1, two_i, 2)}
        for e in range(E):
            for k, proj in enumerate(("gate_proj", "up_proj")):
                ab = get(e, proj)
                if ab is None:
                    continue
                cols = slice(0, r) if one_a else slice(k * r, (k + 1) * r)
                a1[e, cols] = ab[0]
                b1[e, rows[proj], cols] = ab[1]
    if fc2:
        a2 = torch.zeros(E, r, inter, **f32)
        b2 = torch.zeros(E, H, r, **f32)
        for e in range(E):
            ab = get(e, "down_proj")
            if ab is not None:
                a2[e], b2[e] = ab
    shared = shared_outer and one_a
    if shared:            # one copy per layer (every expert's equal, checked above)
        a1 = a1[:1].clone() if a1 is not None else None
        b2 = b2[:1].clone() if b2 is not None else None
    return ExpertAdapter(a1, b1, a2, b2, shared)


def forward(m: nn.Module, own: Callable[..., torch.Tensor], per: dict[int, ExpertAdapter],
            ids_of: Callable[[int], torch.Tensor | None]) -> Callable[..., torch.Tensor]:
    """The experts module's forward with each token's adapter (see the module docstring). ``own``: the module's
    forward; ``per``: adapter index -> its ``ExpertAdapter`` here; ``ids_of(T)``: the adapter index of each of the
    forward's ``T`` tokens (None: no rows known, run the base)."""
    transposed, _, bias = _layout(m)

    def linear(x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        w = getattr(m, name)[e]
        y = x @ w if transposed else nn.functional.linear(x, w)
        return y + getattr(m, name + "_bias")[e] if bias else y

    def run(hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, *args: Any, **kw: Any):
        ids = ids_of(hidden_states.shape[0])
        present = [] if ids is None else [i for i in ids.unique().tolist() if i in per]
        if not present:
            return own(hidden_states, index, weights, *args, **kw)
        num = m.gate_up_proj.shape[0]
        out = torch.zeros_like(hidden_states)
        # shared outer A: one A x per adapter for all its tokens
        ax = {i: hidden_states.float() @ per[i].a1[0].T for i in present if per[i].shared and per[i].a1 is not None}
        mask = nn.functional.one_hot(index, num_classes=num + 1).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            if e == num:
                continue
            pos, tok = torch.where(mask[e])
            x = hidden_states[tok]
            tid = ids[tok]
            sels = {i: (tid == i).nonzero().squeeze(1) for i in present}
            gate_up = linear(x, "gate_up_proj", e)
            for i, sel in sels.items():
                ad = per[i]
                if ad.a1 is None or sel.numel() == 0:
                    continue
                h = ax[i][tok[sel]] if i in ax else x.index_select(0, sel).float() @ ad.a1[e].T
                gate_up.index_add_(0, sel, (h @ ad.b1[e].T).to(gate_up.dtype))
            act = m._apply_gate(gate_up)
            y = linear(act, "down_proj", e)
            for i, sel in sels.items():
                ad = per[i]
                if ad.a2 is None or sel.numel() == 0:
                    continue
                h = act.index_select(0, sel).float() @ ad.a2[e].T
                y.index_add_(0, sel, (h @ ad.b2[0 if ad.shared else e].T).to(y.dtype))
            out.index_add_(0, tok, (y * weights[tok, pos, None]).to(out.dtype))
        return out

    return run
