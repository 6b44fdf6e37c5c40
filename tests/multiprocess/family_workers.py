"""Workers shared by the Megatron family tests (``test_megatron_<family>.py``): run under real torchrun by each
test's ``__main__``. A family's tiny checkpoint goes through the Megatron backend's own path (``ModelShape`` from
config.json, ``build_gpt_model``, ``convert.load_hf_into``, ``export.iter_hf_buckets``) and is compared with
transformers' model of the same directory."""

from __future__ import annotations

import json
from pathlib import Path


def hf_lm(model_dir: str, **kw):
    """transformers' own model of ``model_dir``: its causal LM, or for a multimodal checkpoint whose model type has
    none (Kimi-K2.5) its image-text-to-text model, run on text."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = AutoConfig.from_pretrained(model_dir).model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return (AutoModelForCausalLM if causal else AutoModelForImageTextToText).from_pretrained(model_dir, **kw)


def gpt_worker(model_dir: str, out: str, ep: int = 1, seq: int = 20, mtp: bool = False,
               reference: str = "disk", text_vocab: int | None = None) -> None:
    """TP = world size (``ep`` 1), or TP 1 x EP = world size (the experts split over the ranks, all-to-all); 2 rows
    of ``seq`` random tokens. Writes to ``out`` (json): the logits' max distance to transformers' (fp32, eager),
    whether every gradient is finite, the exported HF names and those equal to the checkpoint bit for bit; at EP 1
    the full gradients under HF names beside it (``<out>.grads.safetensors``); ``max_lp_err``: the log-probs' distance. ``mtp``: the checkpoint's MTP layers
    are built too (frozen, as without --enable-mtp-training) and exported. ``reference`` "transformers": the export is
    compared with the state dict transformers loads (a checkpoint named otherwise than transformers names its modules:
    DeepSeek-V4's) rather than the safetensors file. ``text_vocab``: the token ids drawn stay below it (a
    multimodal checkpoint's image / video ids, which transformers embeds otherwise, above)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from miles.trainer.megatron import convert, export, model, moe, parallel

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world // ep
    cpu = torch.device("cpu")
    groups = parallel.init_parallel(tp_size=tp, num_trainer_ranks=world, seed=1, device=cpu, ep_size=ep)
    moe.apply_moe_compat()
    moe.apply_moe_cpu_compat()
    shape = model.ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    if mtp:
        from dataclasses import replace

        shape = replace(shape, mtp_num_layers=shape.nextn_layers)
    padded = model.padded_vocab_size(shape.vocab_size, 128, tp)
    kw = moe.config_kwargs(shape, moe.MoeOptions(), ep=ep, etp=1, te=False)
    config = model.transformer_config(shape, tp_size=tp, device=cpu, moe=kw, sequence_parallel=tp > 1)
    gpt = model.build_gpt_model(shape, config, padded_vocab=padded, device=cpu)
    hf_sd = convert.read_hf_state_dict(model_dir)
    convert.load_hf_into(gpt, hf_sd, shape, padded, groups.tp_rank, tp, ep_rank=groups.ep_rank, ep_size=ep)

    torch.manual_seed(0)
    ids = torch.randint(4, text_vocab or shape.vocab_size, (2, seq))
    pos = torch.arange(seq).unsqueeze(0).expand(2, -1)
    hidden = gpt(ids, pos, attention_mask=None)                       # [s / tp (sequence parallel), b, h]
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import (
            gather_from_sequence_parallel_region,
            gather_from_tensor_model_parallel_region,
        )

        hidden = gather_from_sequence_parallel_region(hidden)
    local = hidden.transpose(0, 1) @ model.output_weight(gpt).t()     # [b, s, V / tp]
    full = gather_from_tensor_model_parallel_region(local) if tp > 1 else local
    logits = full[..., :shape.vocab_size]
    logits.square().mean().backward()
    if ep == 1:
        parallel.finish_grads(gpt, groups)
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gpt.parameters()
                   if p.requires_grad)
    no_grad = [n for n, p in gpt.named_parameters() if p.grad is None]      # (EP: no finish_grads zero-fill)
    finite_ok = all(bool(torch.isfinite(p.grad).all()) for p in gpt.parameters() if p.grad is not None)
    logits = logits.detach()

    exported = [pair for bucket in export.iter_hf_buckets(gpt, shape, groups, device=cpu, bucket_bytes=1 << 14)
                for pair in bucket]
    hf = hf_lm(model_dir, dtype=torch.float32, attn_implementation="eager")
    disk = load_file(str(Path(model_dir) / "model.safetensors")) if reference == "disk" else {
        n: t.detach().clone() for n, t in hf.state_dict().items()}
    same = [n for n, t in exported if n in disk and disk[n].dtype == t.dtype and torch.equal(disk[n], t)]
    with torch.no_grad():                  # the full gradients in HF names: the export of p.grad in place of p
        for p in gpt.parameters() if ep == 1 and not mtp else ():
            if p.grad is not None:         # (a frozen parameter, DeepSeek-V4's indexer: its weight stands in)
                p.data, p.grad = p.grad, p.data
        grads = {n: t.clone() for bucket in export.iter_hf_buckets(gpt, shape, groups, device=cpu, bucket_bytes=1 << 14)
                 for n, t in bucket}
    if rank == 0 and ep == 1 and not mtp:
        from safetensors.torch import save_file

        save_file(grads, str(Path(out).with_suffix(".grads.safetensors")))

    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    lp_err = (torch.log_softmax(logits, -1) - torch.log_softmax(ref, -1)).abs().max()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "max_abs_err": float((logits - ref).abs().max()), "max_lp_err": float(lp_err),
            "ref_scale": float(ref.abs().max()),
            "grads_ok": grads_ok, "no_grad": no_grad,
            "finite_ok": finite_ok, "exported": [n for n, _ in exported], "same": same, "disk": sorted(disk)}))
    dist.destroy_process_group()


def parity_worker(model_dir: str, out: str, megatron_flags: tuple[str, ...] = (), tp: int = 2) -> None:
    """2 ranks: the FSDP backend (transformers' model under FSDP2, DP 2) and the Megatron trainer (TP ``tp``,
    sequence parallel, ``megatron_flags``) train the same 2 rollouts from ``model_dir``. Saves to ``out`` (torch.save): both
    backends' log-probs' distance before training, step metrics, the update's distance, the export against the
    checkpoint (fp32 and bf16), ``--save-hf`` reloaded in transformers, a torch_dist checkpoint resumed bitwise."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from test_megatron import _all_logprobs, _flags
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    samples = random_samples(4, 4, seed=7, vocab=90)
    mine = samples[:8] if rank == 0 else samples[8:]
    res: dict = {}
    fsdp = build(model_dir, _flags("fsdp", 1), group=group)
    res["fsdp_attention"] = fsdp.model.lm.config._attn_implementation if hasattr(fsdp.model, "lm") else None
    fsdp_lp = _all_logprobs(fsdp, samples)
    res["fsdp_metrics"] = [fsdp.train(mine, rid) for rid in range(2)]
    fsdp_sd = fsdp.state_dict_for_check()
    del fsdp
    flags = ("--sequence-parallel", *megatron_flags, "--save", str(Path(out).parent / "ckpt"))
    meg = build(model_dir, _flags("megatron", tp, megatron_flags=flags), group=group)
    init = meg.state_dict_for_check()
    init_bf16 = {n: t.detach().cpu().clone() for b in meg.iter_weight_buckets(4096, torch.bfloat16) for n, t in b}
    meg_lp = _all_logprobs(meg, samples)
    res["meg_metrics"] = [meg.train(mine, rid) for rid in range(2)]
    meg_sd = meg.state_dict_for_check()
    meg.save_hf(Path(out).parent / "hf_out")
    meg.checkpoint(1, {"rollout_id": 1})
    meg.train(mine, 2)                                  # move away, then load the checkpoint back
    res["resumed_extra"] = meg.resume()
    reloaded = meg.state_dict_for_check()
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = load_file(str(Path(model_dir) / "model.safetensors"))
        res["ckpt_reload_bitwise"] = sorted(reloaded) == sorted(meg_sd) and all(
            torch.equal(reloaded[k], meg_sd[k]) for k in meg_sd)
        hf_model = AutoModelForCausalLM.from_pretrained(Path(out).parent / "hf_out")
        saved = {n: t.detach().cpu() for n, t in hf_model.state_dict().items()}
        if sorted(saved) != sorted(meg_sd):        # transformers 5 fuses per-expert checkpoints' experts on load
            from test_megatron_moe import split_fused_experts

            saved = split_fused_experts(saved)
        res["save_hf_equal"] = sorted(saved) == sorted(meg_sd) and all(torch.equal(saved[k], meg_sd[k]) for k in meg_sd)
        res["export_keys_equal"] = sorted(init) == sorted(hf) == sorted(meg_sd) == sorted(fsdp_sd)
        res["export_bitwise"] = all(torch.equal(init[k], hf[k]) for k in hf)
        res["export_bf16_bitwise"] = all(torch.equal(init_bf16[k], hf[k].bfloat16()) for k in hf)
        keys = sorted(fsdp_sd)
        deltas = {k: ((meg_sd[k] - hf[k]) - (fsdp_sd[k] - hf[k])).abs().max().item() for k in keys}
        res["update_max_abs_diff"], res["update_worst"] = max(deltas.values()), max(deltas, key=deltas.get)
        num = sum(((meg_sd[k] - fsdp_sd[k]).double() ** 2).sum().item() for k in keys)
        den = sum(((fsdp_sd[k] - hf[k]).double() ** 2).sum().item() for k in keys)
        res["update_rel_l2"] = (num / den) ** 0.5
        res["lp_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(fsdp_lp, meg_lp))
        torch.save(res, out)
    dist.destroy_process_group()


def gpu_worker(model_dir: str, out: str, seq: int = 20, text_vocab: int | None = None) -> None:
    """One rank on GPU 0 (NCCL), bf16 parameters, TP 1: the Megatron GPTModel's logits against transformers' own
    model (eager attention, bf16, and fp32 for the scale of bf16 rounding) on the same rows (``text_vocab``: as
    ``gpt_worker``'s)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from miles.trainer.megatron import convert, model, moe, parallel

    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    parallel.init_parallel(tp_size=1, num_trainer_ranks=1, seed=1, device=dev)
    moe.apply_moe_compat()
    shape = model.ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    padded = model.padded_vocab_size(shape.vocab_size, 128, 1)
    kw = moe.config_kwargs(shape, moe.MoeOptions(), ep=1, etp=1, te=False)
    config = model.transformer_config(shape, tp_size=1, device=dev, moe=kw, params_dtype=torch.bfloat16, bf16=True)
    gpt = model.build_gpt_model(shape, config, padded_vocab=padded, device=dev)
    convert.load_hf_into(gpt, convert.read_hf_state_dict(model_dir), shape, padded, 0, 1)
    torch.manual_seed(0)
    ids = torch.randint(4, text_vocab or shape.vocab_size, (2, seq), device=dev)
    pos = torch.arange(seq, device=dev).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        hidden = gpt(ids, pos, attention_mask=None)
        logits = (hidden.transpose(0, 1) @ model.output_weight(gpt).t())[..., :shape.vocab_size].float()
        hf = hf_lm(model_dir, dtype=torch.bfloat16, attn_implementation="eager").to(dev)
        ref = hf(input_ids=ids).logits.float()
        hf32 = hf_lm(model_dir, dtype=torch.float32, attn_implementation="eager").to(dev)
        ref32 = hf32(input_ids=ids).logits
    Path(out).write_text(json.dumps({"max_abs_err": float((logits - ref).abs().max()),
                                     "hf_bf16_vs_fp32": float((ref - ref32).abs().max()),
                                     "ref_scale": float(ref32.abs().max())}))
    dist.destroy_process_group()


def train_worker(model_dir: str, out: str, megatron_flags: str = "") -> None:
    """The Megatron trainer of ``megatron_flags`` (comma-separated, after ``test_megatron._flags``' TP 1) trains 2
    rollouts of 4 prompts x 4 samples, split evenly over the ranks in order (the model-parallel group gathers them
    back in that order, so runs of any layout with DP 1 train the same micro-batches). Saves to ``out`` from rank 0
    (torch.save): the log-probs before training, the step metrics, the weights before and after (HF names)."""
    import torch
    import torch.distributed as dist
    from test_megatron import _all_logprobs, _flags
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = random_samples(4, 4, seed=7, vocab=90)
    per = len(samples) // world
    mine = samples[per * rank:per * (rank + 1)]
    tr = build(model_dir, _flags("megatron", 1, megatron_flags=tuple(f for f in megatron_flags.split(",") if f)))
    res = {"init": tr.state_dict_for_check(), "lp": _all_logprobs(tr, samples)}
    res["metrics"] = [tr.train(mine, rid) for rid in range(2)]
    res["final"] = tr.state_dict_for_check()
    res["layout"] = (tr.groups.tp_size, tr.groups.pp_size, tr.groups.dp_size, tr._sequence_parallel)
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()


def compare_runs(a: dict, b: dict) -> dict:
    """Two ``train_worker`` results: the log-probs' max distance, each step metric's largest relative distance,
    the updates' max distance and their distance relative to ``a``'s update (L2)."""
    keys = sorted(a["final"])
    assert keys == sorted(b["final"]) == sorted(a["init"]) and all(a["init"][k].equal(b["init"][k]) for k in keys)
    upd = {k: ((b["final"][k] - b["init"][k]) - (a["final"][k] - a["init"][k])).abs().max().item() for k in keys}
    num = sum(((b["final"][k] - a["final"][k]).double() ** 2).sum().item() for k in keys)
    den = sum(((a["final"][k] - a["init"][k]).double() ** 2).sum().item() for k in keys)
    metric = {key: max(abs(ma[key] - mb[key]) / max(1.0, abs(ma[key])) for ma, mb in zip(a["metrics"], b["metrics"]))
              for key in ("loss", "pg_loss", "entropy", "ppo_kl", "tis", "grad_norm", "num_tokens", "kl_loss")}
    return {"lp_max_abs_diff": max((x - y).abs().max().item() for x, y in zip(a["lp"], b["lp"])),
            "metric_rel": metric, "update_max_abs_diff": max(upd.values()), "update_worst": max(upd, key=upd.get),
            "update_max_abs": max((a["final"][k] - a["init"][k]).abs().max().item() for k in keys),
            "update_rel_l2": (num / den) ** 0.5}
