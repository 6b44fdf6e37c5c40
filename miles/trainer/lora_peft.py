"""The LoRA adapters in HF PEFT form (``miles.trainer.lora`` documents the design): the whole model's pairs gathered
over TP / EP / PP (``full_pairs``), their PEFT names (``peft_tensors``: Megatron's fused targets split into the HF
modules; ``expert_peft_tensors``: a routed expert of a fused HF experts tensor, named per expert, which the FSDP
backend's ``lora_hf.peft_tensors`` uses too), and the adapter directory / ``adapter_config.json``
(``write_peft_adapter``, ``peft_config``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from miles.trainer.lora_adapters import LoraAdapters, LoraSpec


@torch.no_grad()
def full_pairs(lora: LoraAdapters, shape=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Megatron module name (global layer index; routed experts: EP-free, global index) -> (A, B) of the whole model
    (TP shards, EP ranks' experts and pipeline stages gathered, a column target's B rows joined as its weight's are:
    ``shape``, the model's ``ModelShape``, for a family's sectioned weights such as the gated DeltaNet's
    ``in_proj``; CPU fp32); collective on TP, EP and PP."""
    from miles.trainer.megatron.convert import unshard
    from miles.trainer.megatron.moe import global_name

    out = {}
    for local, pair in lora.named_pairs():
        name = lora.stage_names.get(local, local)
        a, b = pair.lora_A.detach().float(), pair.lora_B.detach().float()
        if pair.kind == "expert":
            if lora.ep_size == 1:
                out[name] = (a.cpu(), b.cpu())
                continue
            both = torch.cat([a.reshape(-1), b.reshape(-1)]).contiguous()
            parts = [torch.empty_like(both) for _ in range(lora.ep_size)]
            dist.all_gather(parts, both, group=lora.ep_group)
            for r, t in enumerate(parts):
                gname = global_name(name + ".weight", r, lora.num_local).removesuffix(".weight")
                out[gname] = (t[:a.numel()].view_as(a).cpu(), t[a.numel():].view_as(b).cpu())
            continue
        if lora.tp_size > 1 and pair.sharded is not None:
            sh = pair.sharded.detach().float().contiguous()
            parts = [torch.empty_like(sh) for _ in range(lora.tp_size)]
            dist.all_gather(parts, sh, group=lora.tp_group)
            if pair.kind == "column":
                b = unshard(name + ".weight", parts, 0, shape)  # fc1's shards are [gate_r; up_r], in_proj's by section
            else:
                a = torch.cat(parts, dim=1)
        out[name] = (a.cpu(), b.cpu())
    if lora.pp_size > 1:
        from miles.trainer.collectives import bounded_all_gather_object

        parts = bounded_all_gather_object(out, lora.pp_group, lora.timeout, lora.device,
                                          "gathering the pipeline stages' LoRA adapters")
        out = {k: v for part in parts for k, v in part.items()}
    return out


def peft_tensors(lora: LoraAdapters, shape) -> list[tuple[str, torch.Tensor]]:
    """The adapters in HF PEFT names (``base_model.model.<HF module>.lora_A.weight`` / ``lora_B``): the fused
    linear_qkv / linear_fc1 become q/k/v and gate/up modules sharing ``A``, each with its rows of ``B``;
    collective on TP. A routed expert whose HF checkpoint keeps the experts fused (gpt-oss's ``mlp.experts.
    gate_up_proj``: the converter names its slice ``<fused>#<e>``) is named per expert as PEFT and the engines name
    it, ``mlp.experts.<e>.gate_proj`` / ``up_proj`` (Megatron's ``B`` rows [gate; up]) / ``down_proj``."""
    return peft_named(full_pairs(lora, shape), shape)


def peft_named(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], shape) -> list[tuple[str, torch.Tensor]]:
    """``peft_tensors`` of the whole model's pairs (``full_pairs``: Megatron module name -> (A, B)); copies, never
    views of the live adapters (a caller may keep them while training goes on)."""
    from miles.trainer.megatron.convert import megatron_to_hf

    out = []
    for name, (a, b) in pairs.items():
        hf_names = megatron_to_hf(name + ".weight", b, shape)
        if any("#" in hf for hf, _ in hf_names):          # a fused experts tensor's slice: per-expert PEFT names
            fused, _, e = hf_names[0][0].partition("#")
            out += expert_peft_tensors(fused, int(e), a, b, gate_up=name.endswith("linear_fc1"))
            continue
        for hf, rows in hf_names:
            module = "base_model.model." + hf.removesuffix(".weight")
            out += [(module + ".lora_A.weight", a.clone()),
                    (module + ".lora_B.weight", rows.clone(memory_format=torch.contiguous_format))]
    return out


def expert_peft_tensors(fused: str, e: int, a: torch.Tensor, b: torch.Tensor, *,
                        gate_up: bool) -> list[tuple[str, torch.Tensor]]:
    """PEFT names and tensors of routed expert ``e``'s adapter on the fused HF experts tensor ``fused`` (``<experts
    module>.gate_up_proj`` / ``down_proj``), named per expert as PEFT and the engines name it: ``base_model.model.
    <experts module>.<e>.{gate_proj, up_proj | down_proj}.lora_{A,B}.weight``; a ``gate_up`` adapter's ``B`` rows are
    [gate; up] (Megatron's ``linear_fc1`` layout), each half with the shared ``A``. Copies: never views of ``a``, ``b``.
    The one naming of both backends (``peft_named``, ``lora_hf.peft_tensors``)."""
    prefix = f"base_model.model.{fused.rsplit('.', 1)[0]}.{e}"
    parts = list(zip(("gate_proj", "up_proj"), b.chunk(2, dim=0))) if gate_up else [("down_proj", b)]
    out = []
    for proj, rows in parts:
        out += [(f"{prefix}.{proj}.lora_A.weight", a.clone()), (f"{prefix}.{proj}.lora_B.weight",
                                                                rows.clone(memory_format=torch.contiguous_format))]
    return out


def write_peft_adapter(path, tensors: list[tuple[str, torch.Tensor]], spec: LoraSpec, base: str | None) -> None:
    """``path/adapter_model.safetensors`` + ``adapter_config.json`` (what ``peft.PeftModel.from_pretrained`` reads)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(tensors, spec, base), indent=2) + "\n")


def peft_config(tensors: list[tuple[str, torch.Tensor]], spec: LoraSpec, base: str | None) -> dict:
    """adapter_config.json of ``tensors`` (PEFT names), also the ``config_dict`` of an adapter sent to the engines."""
    modules = sorted({k.rsplit(".", 3)[1] for k, _ in tensors})      # <prefix>.<module>.lora_X.weight
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": modules, "bias": "none",
            "base_model_name_or_path": base, "fan_in_fan_out": False, "inference_mode": True}
