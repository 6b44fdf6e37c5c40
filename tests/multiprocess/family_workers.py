"""What the Megatron family tests (``test_megatron_<family>.py``) share: the workers their ``__main__`` runs under
real torchrun, and the checks the tests make of what the workers write. A family's tiny checkpoint goes through the
Megatron backend's own path (``ModelShape`` from config.json, ``build_gpt_model``, ``convert.load_hf_into``,
``export.iter_hf_buckets``) and is compared with transformers' model of the same directory (``gpt_worker``, on GPU
``gpu_worker``) and with the FSDP backend training the same rollouts (``parity_worker``); ``train_worker`` trains
the Megatron trainer in one layout, ``compare_runs`` compares two layouts' runs.

A family's test passes only what differs: its flags, its row length, its bounds (with the measurement beside them);
``launch`` runs a worker and reads its result, ``check_export``, ``check_grads_match``, ``check_parity``,
``check_gpu_matches_hf``, ``check_gpu_bf16_parity`` and ``check_engine_greedy`` (the embedded engine against
transformers' greedy decoding) assert what every family asserts; ``save_hf`` and the checkpoint round trip after
training are ``save_and_resume``."""

from __future__ import annotations

import json
from pathlib import Path

# every step metric the parity tests compare between the backends (relative 1e-5)
METRICS = ("loss", "pg_loss", "entropy", "ppo_kl", "tis", "grad_norm", "num_samples", "num_tokens", "advantages_mean",
           "kl_loss", "reward_kl_mean")


# ------------------------------------------------------------------------------------------- in the ranks
def hf_lm(model_dir: str, **kw):
    """transformers' own model of ``model_dir``: its causal LM, or for a multimodal checkpoint whose model type has
    none (Kimi-K2.5) its image-text-to-text model, run on text."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model_dir)
    causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or type(config) in AutoModelForCausalLM._model_mapping
    return (AutoModelForCausalLM if causal else AutoModelForImageTextToText).from_pretrained(model_dir, **kw)


def build_loaded(model_dir: str, *, tp: int, ep: int = 1, device, dtype=None, core_attention: str = "sdpa",
                 mtp: bool = False, router_dtype: str | None = None, cp: int = 1, dispatcher: str | None = None):
    """The Megatron backend's model of ``model_dir`` at TP ``tp`` (sequence parallel when > 1) x EP ``ep`` on
    ``device``, its parameters in ``dtype`` (fp32; bf16 turns on megatron-core's bf16), loaded from the checkpoint
    (the MoE layers configured by ``moe.config_kwargs`` as the trainer does). ``mtp``: the checkpoint's MTP layers
    built too (frozen, as without --enable-mtp-training). ``cp``: x CP (``--context-parallel-size``, the
    all-gather attention). ``dispatcher``: ``--moe-token-dispatcher-type`` (None: the trainer's default). Returns
    (model, shape, groups)."""
    import torch

    from miles.trainer.megatron import compat, convert, model, moe, parallel
    from miles.utils.model_dir import load_config

    dtype = dtype or torch.float32
    groups = parallel.init_parallel(tp_size=tp, num_trainer_ranks=tp * ep * cp, seed=1, device=device, ep_size=ep,
                                    cp_size=cp)
    shape = model.ModelShape.from_hf_config(load_config(model_dir))     # an aliased model_type registered
    if mtp:
        from dataclasses import replace

        shape = replace(shape, mtp_num_layers=shape.nextn_layers)
    kw = None
    if shape.num_experts:
        compat.apply_moe_compat()
        if device.type == "cpu":
            compat.apply_moe_cpu_compat()
        kw = moe.config_kwargs(shape, moe.MoeOptions(router_dtype=router_dtype, dispatcher=dispatcher), ep=ep, etp=1,
                               te=False)
    padded = model.padded_vocab_size(shape.vocab_size, 128, tp)
    config = model.transformer_config(shape, tp_size=tp, device=device, params_dtype=dtype, moe=kw,
                                      bf16=dtype == torch.bfloat16, sequence_parallel=tp > 1, cp_size=cp)
    gpt = model.build_gpt_model(shape, config, padded_vocab=padded, device=device, core_attention=core_attention)
    convert.load_hf_into(gpt, convert.read_hf_state_dict(model_dir), shape, padded, groups.tp_rank, tp,
                         ep_rank=groups.ep_rank, ep_size=ep)
    return gpt, shape, groups


def full_logits(gpt, shape, ids, pos, tp: int):
    """The model's logits [b, s, vocab] on every TP rank: the sequence-parallel hidden states gathered, then the
    vocab-parallel logits (both gathers sum the TP ranks' parts in the backward)."""
    from miles.trainer.megatron import model

    hidden = gpt(ids, pos, attention_mask=None)                       # [s / tp (sequence parallel), b, h]
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(hidden)
    logits = hidden.transpose(0, 1) @ model.output_weight(gpt).t()    # [b, s, V / tp]
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., :shape.vocab_size]


def hf_grads(gpt, shape, groups, device, frozen: str = "weight") -> dict:
    """The full gradients under HF names: the export of each ``p.grad`` in place of ``p`` (the model is left
    holding them). A parameter without a gradient (a frozen one: DeepSeek-V4's, DSA's indexer) exports its weight
    (``frozen`` "weight") or zeros ("zero")."""
    import torch

    from miles.trainer.megatron import export

    with torch.no_grad():
        for p in gpt.parameters():
            if p.grad is not None or frozen == "zero":
                p.data, p.grad = (p.grad if p.grad is not None else torch.zeros_like(p)), p.data
        return {n: t.clone() for bucket in export.iter_hf_buckets(gpt, shape, groups, device=device,
                                                                  bucket_bytes=1 << 14) for n, t in bucket}


def gpt_worker(model_dir: str, out: str, ep: int = 1, seq: int = 20, mtp: bool = False,
               text_vocab: int | None = None, *, attn_implementation: str | None = "eager",
               frozen: str = "weight", reference_dir: str | None = None) -> None:
    """TP = world size (``ep`` 1), or TP 1 x EP = world size (the experts split over the ranks, all-to-all); 2 rows
    of ``seq`` random tokens. Writes to ``out`` (json): the logits' max distance to transformers' (fp32,
    ``attn_implementation``) and the log-probs' (``max_lp_err``), whether every gradient is finite, the exported HF
    names and those equal to the checkpoint bit for bit; at EP 1 the full gradients under HF names beside it
    (``<out>.grads.safetensors``, ``hf_grads`` with ``frozen``). ``mtp``: the checkpoint's MTP layers are built too
    and exported. ``text_vocab``: the token ids drawn stay below it (a multimodal checkpoint's image / video ids, which
    transformers embeds otherwise, above). ``reference_dir``: transformers' model is loaded from there instead (the
    same weights in a layout transformers builds here, e.g. Inkling's text model for its published multimodal
    checkpoint, whose vision tower needs scipy)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles.trainer.megatron import export, parallel

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world // ep
    cpu = torch.device("cpu")
    gpt, shape, groups = build_loaded(model_dir, tp=tp, ep=ep, device=cpu, mtp=mtp)

    torch.manual_seed(0)
    ids = torch.randint(4, text_vocab or shape.vocab_size, (2, seq))
    pos = torch.arange(seq).unsqueeze(0).expand(2, -1)
    logits = full_logits(gpt, shape, ids, pos, tp)
    logits.square().mean().backward()                                 # the same loss on every TP rank
    if ep == 1:
        parallel.finish_grads(gpt, groups)                            # TP sums (sequence-parallel norms, router)
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gpt.parameters()
                   if p.requires_grad)
    no_grad = [n for n, p in gpt.named_parameters() if p.grad is None]      # (EP: no finish_grads zero-fill)
    finite_ok = all(bool(torch.isfinite(p.grad).all()) for p in gpt.parameters() if p.grad is not None)
    logits = logits.detach()

    exported = [pair for bucket in export.iter_hf_buckets(gpt, shape, groups, device=cpu, bucket_bytes=1 << 14)
                for pair in bucket]
    hf = hf_lm(reference_dir or model_dir, dtype=torch.float32, attn_implementation=attn_implementation)
    disk = load_file(str(Path(model_dir) / "model.safetensors"))
    same = [n for n, t in exported if n in disk and disk[n].dtype == t.dtype and torch.equal(disk[n], t)]
    if ep == 1 and not mtp:
        grads = hf_grads(gpt, shape, groups, cpu, frozen)
        if rank == 0:
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
            "finite_ok": finite_ok, "exported": [n for n, _ in exported], "same": same, "disk": sorted(disk),
            "expert_shapes": {n: list(p.shape) for n, p in gpt.named_parameters() if ".mlp.experts." in n}}))
    dist.destroy_process_group()


def gpu_worker(model_dir: str, out: str, seq: int = 20, text_vocab: int | None = None, *,
               attn_implementation: str | None = "eager", router_dtype: str | None = None, info=None,
               hf_autocast: bool = False) -> None:
    """One rank on GPU 0 (NCCL), bf16 parameters, TP 1: the Megatron model's logits and log-probs against
    transformers' own model (``attn_implementation``, bf16, and fp32 for the scale of bf16 rounding) on the same rows
    (``text_vocab``: as ``gpt_worker``'s). ``router_dtype``: --moe-router-dtype; ``info()``: more entries for
    ``out``, computed after the forwards. ``hf_autocast``: transformers' bf16 forward under CUDA autocast, for a
    model whose own code mixes fp32 activations into bf16 layers (DeepSeek-V4's hyper-connections)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gpt, shape, _ = build_loaded(model_dir, tp=1, device=dev, dtype=torch.bfloat16, router_dtype=router_dtype)
    torch.manual_seed(0)
    ids = torch.randint(4, text_vocab or shape.vocab_size, (2, seq), device=dev)
    pos = torch.arange(seq, device=dev).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        logits = full_logits(gpt, shape, ids, pos, 1).float()
        hf = hf_lm(model_dir, dtype=torch.bfloat16, attn_implementation=attn_implementation).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=hf_autocast):
            ref = hf(input_ids=ids).logits.float()
        hf32 = hf_lm(model_dir, dtype=torch.float32, attn_implementation=attn_implementation).to(dev)
        ref32 = hf32(input_ids=ids).logits
    lp, ref_lp, ref32_lp = (torch.log_softmax(x, -1) for x in (logits, ref, ref32))
    Path(out).write_text(json.dumps({"max_abs_err": float((logits - ref).abs().max()),
                                     "max_abs_err_vs_fp32": float((logits - ref32).abs().max()),
                                     "hf_bf16_vs_fp32": float((ref - ref32).abs().max()),
                                     "ref_scale": float(ref32.abs().max()),
                                     "max_lp_err": float((lp - ref_lp).abs().max()),
                                     "hf_lp_bf16_vs_fp32": float((ref_lp - ref32_lp).abs().max()),
                                     **(info() if info else {})}))
    dist.destroy_process_group()


def parity_worker(model_dir: str, out: str, megatron_flags: tuple[str, ...] = (), tp: int = 2, *,
                  flags: tuple[str, ...] = (), saved: str = "transformers", bf16_export: bool = True,
                  vlm: bool = False, split_fsdp_experts: bool = False) -> None:
    """2 ranks: the FSDP backend (transformers' model under FSDP2, DP 2) and the Megatron trainer (TP ``tp``,
    sequence parallel, ``megatron_flags``) train the same 2 rollouts from ``model_dir`` (``flags``: to both). Saves
    to ``out`` (torch.save): both backends' log-probs' distance before training, step metrics, the update's distance
    (over the tensors both export), the names only one backend exports, the Megatron export before training
    against the checkpoint's safetensors (fp32, and bf16 with ``bf16_export``), ``--save-hf`` (``saved`` "transformers": reloaded by transformers;
    "disk": the safetensors written, transformers loading them), a torch_dist checkpoint resumed bitwise.
    ``vlm``: a multimodal checkpoint trained text-only (the FSDP samples without images; the text decoder's tensors,
    ``model.language_model.*``, compared; ``--save-hf`` holds the towers as they were). ``split_fsdp_experts``:
    the FSDP export's fused experts split per expert before the comparison. ``res["layout"]``: the Megatron trainer's
    parallel sizes."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from test_megatron import _all_logprobs, _flags
    from test_megatron_moe import split_fused_experts
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    samples = random_samples(4, 4, seed=7, vocab=90)
    mine = samples[:8] if rank == 0 else samples[8:]
    res: dict = {}
    fsdp = build(model_dir, _flags("fsdp", 1) + list(flags), group=group)
    if vlm:
        fsdp._mm = [None] * len(samples)                # a VLM on FSDP: these samples have no images (as train sets)
    fsdp_lp = _all_logprobs(fsdp, samples)
    res["fsdp_metrics"] = [fsdp.train(mine, rid) for rid in range(2)]
    fsdp_sd = fsdp.state_dict_for_check()
    if split_fsdp_experts:
        fsdp_sd = split_fused_experts(fsdp_sd)
    del fsdp
    hf_out = Path(out).parent / "hf_out"
    meg_flags = ("--sequence-parallel", *megatron_flags, "--save", str(Path(out).parent / "ckpt"))
    meg = build(model_dir, _flags("megatron", tp, megatron_flags=meg_flags) + list(flags), group=group)
    res["layout"] = {k: getattr(meg.groups, k) for k in ("tp_size", "pp_size", "cp_size", "ep_size", "dp_size")}
    init = meg.state_dict_for_check()
    if bf16_export:
        init_bf16 = {n: t.detach().cpu().clone() for b in meg.iter_weight_buckets(4096, torch.bfloat16) for n, t in b}
    meg_lp = _all_logprobs(meg, samples)
    res["meg_metrics"] = [meg.train(mine, rid) for rid in range(2)]
    meg_sd, res["resumed_extra"], reloaded = save_and_resume(meg, mine, hf_out)
    if rank == 0:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
        ref = load_file(str(Path(model_dir) / "model.safetensors"))
        trained = sorted(k for k in ref if k.startswith("model.language_model." if vlm else ""))
        res["ckpt_reload_bitwise"] = sorted(reloaded) == sorted(meg_sd) and all(
            torch.equal(reloaded[k], meg_sd[k]) for k in meg_sd)
        if saved == "disk":
            saved_sd = load_file(str(hf_out / "model.safetensors"))
            auto.from_pretrained(hf_out)               # transformers loads what we wrote
        else:
            saved_sd = {n: t.detach().cpu() for n, t in auto.from_pretrained(hf_out).state_dict().items()}
            if not vlm and sorted(saved_sd) != sorted(meg_sd):   # transformers 5 fuses per-expert checkpoints'
                saved_sd = split_fused_experts(saved_sd)         # experts on load
        if vlm:                                        # the trained text decoder, the towers as they were
            res["save_hf_equal"] = all(torch.equal(saved_sd[k], meg_sd[k]) for k in meg_sd)
            on_disk = load_file(str(hf_out / "model.safetensors"))
            res["save_hf_keys_equal"] = sorted(on_disk) == sorted(ref)
            res["save_hf_towers_equal"] = all(torch.equal(on_disk[k], ref[k]) for k in ref if k not in meg_sd)
        else:
            res["save_hf_equal"] = sorted(saved_sd) == sorted(meg_sd) and all(
                torch.equal(saved_sd[k], meg_sd[k]) for k in meg_sd)
        res["export_keys_equal"] = sorted(init) == trained == sorted(meg_sd)
        res["export_bitwise"] = all(torch.equal(init[k], ref[k]) for k in trained)
        if bf16_export:
            res["export_bf16_bitwise"] = all(torch.equal(init_bf16[k], ref[k].bfloat16()) for k in trained)
        # the FSDP backend exports parameters only (a buffer never trained stays with the checkpoint)
        res["meg_keys"] = sorted(meg_sd)
        res["fsdp_missing"] = sorted(set(meg_sd) - set(fsdp_sd))
        res["fsdp_extra"] = sorted(set(fsdp_sd) - set(meg_sd))
        res["fsdp_missing_unchanged"] = all(k in ref and torch.equal(meg_sd[k], ref[k]) for k in res["fsdp_missing"])
        keys = sorted(set(meg_sd) & set(fsdp_sd) & set(ref))
        if keys:                                        # (absent, so a test that bounds them fails, without any)
            res.update(update_distance(meg_sd, fsdp_sd, ref, keys))
        res["lp_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(fsdp_lp, meg_lp))
        torch.save(res, out)
    dist.destroy_process_group()


def update_distance(meg_sd: dict, fsdp_sd: dict, ref: dict, keys) -> dict:
    """How far the Megatron backend's update (``meg_sd - ref``) is from the FSDP backend's (``fsdp_sd - ref``) over
    ``keys``: the largest difference (``update_max_abs_diff``) and its tensor (``update_worst``), the FSDP update's
    largest entry (``update_max_abs``) and the difference's L2 norm relative to the FSDP update's
    (``update_rel_l2``)."""
    deltas = {k: ((meg_sd[k] - ref[k]) - (fsdp_sd[k] - ref[k])).abs().max().item() for k in keys}
    num = sum(((meg_sd[k] - fsdp_sd[k]).double() ** 2).sum().item() for k in keys)
    den = sum(((fsdp_sd[k] - ref[k]).double() ** 2).sum().item() for k in keys)
    return {"update_max_abs_diff": max(deltas.values()), "update_worst": max(deltas, key=deltas.get),
            "update_max_abs": max((fsdp_sd[k] - ref[k]).abs().max().item() for k in keys),
            "update_rel_l2": (num / den) ** 0.5}


def save_and_resume(meg, mine: list, hf_out: Path) -> tuple[dict, dict, dict]:
    """After a Megatron trainer's 2 rollouts (0, 1): its weights (``state_dict_for_check``), ``--save-hf`` to
    ``hf_out``, a torch_dist checkpoint of rollout 1, one more step on ``mine`` (away from it) and the checkpoint
    resumed. Returns (the weights, ``resume``'s extra state, the weights after resuming)."""
    meg_sd = meg.state_dict_for_check()
    meg.save_hf(hf_out)
    meg.checkpoint(1, {"rollout_id": 1})
    meg.train(mine, 2)                                  # move away, then load the checkpoint back
    resumed_extra = meg.resume()
    return meg_sd, resumed_extra, meg.state_dict_for_check()


def train_worker(model_dir: str, out: str, megatron_flags: str = "", device: str = "cpu", resume: bool = False) -> None:
    """The Megatron trainer of ``megatron_flags`` (comma-separated, after ``test_megatron._flags``' TP 1) trains 2
    rollouts of 4 prompts x 4 samples, split evenly over the ranks in order (the model-parallel group gathers them
    back in that order, so runs of any layout with DP 1 train the same micro-batches). Saves to ``out`` from rank 0
    (torch.save): the log-probs before training, the step metrics, the weights before and after (HF names).
    ``device`` "cuda": NCCL, bf16, each rank on the GPU of its local rank among those it sees (one GPU per rank:
    the caller may narrow ``CUDA_VISIBLE_DEVICES`` to it, then ``cuda:0``). ``resume`` (``megatron_flags`` give
    ``--save``): then ``save_and_resume``; ``resumed_bitwise``: the weights resumed from the torch_dist checkpoint
    equal those saved, bit for bit; ``save_hf_keys``: the tensor names ``--save-hf`` wrote."""
    import torch
    import torch.distributed as dist
    from test_megatron import _all_logprobs, _flags
    from trainer_harness import build, random_samples

    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    if device == "cpu":
        dev = torch.device("cpu")
    else:
        import os

        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = random_samples(4, 4, seed=7, vocab=90)
    per = len(samples) // world
    mine = samples[per * rank:per * (rank + 1)]
    tr = build(model_dir, _flags("megatron", 1, megatron_flags=tuple(f for f in megatron_flags.split(",") if f)),
               device=dev)
    res = {"init": tr.state_dict_for_check(), "lp": _all_logprobs(tr, samples)}
    res["metrics"] = [tr.train(mine, rid) for rid in range(2)]
    res["final"] = tr.state_dict_for_check()
    res["layout"] = (tr.groups.tp_size, tr.groups.pp_size, tr.groups.dp_size, tr._sequence_parallel)
    res["cp_size"], res["bf16"], res["ep_size"] = tr.groups.cp_size, tr.bf16, tr.groups.ep_size
    if resume:
        from safetensors.torch import load_file

        hf_out = Path(out).with_suffix(".hf")
        trained, _, resumed = save_and_resume(tr, mine, hf_out)
        res["resumed_bitwise"] = trained.keys() == resumed.keys() and all(torch.equal(trained[k], resumed[k])
                                                                            for k in trained)
        if rank == 0:
            saved = {k: v for f in hf_out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
            res["save_hf_equal"] = saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k])
                                                                          for k in trained)
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- in the tests
def launch(script: Path, nproc: int, port: int, worker: str, model_dir, out: Path, *args, timeout: int = 300):
    """Run ``script``'s ``worker`` on ``nproc`` ranks (``_torchrun.torchrun_self``: the script's ``__main__``
    gets ``worker model_dir out *args``) and return what it wrote to ``out`` (json, else torch.save)."""
    from _torchrun import torchrun_self

    proc = torchrun_self(script, nproc, port, worker, str(model_dir), str(out), *map(str, args), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-5000:]
    if out.suffix == ".json":
        return json.loads(out.read_text())
    import torch

    return torch.load(out, weights_only=False)


def check_export(res: dict) -> None:
    """A ``gpt_worker`` result: the export holds every tensor of the checkpoint once, under its name, bit for bit."""
    assert sorted(res["exported"]) == res["disk"] and len(res["exported"]) == len(set(res["exported"]))
    assert sorted(res["same"]) == res["disk"], sorted(set(res["disk"]) - set(res["same"]))       # bit for bit


def check_grads_match(one: dict, two: dict, rel: float, *, floor: float = 0.0, scale_floor: float = 0.0) -> None:
    """TP 2's gradients (``two``, HF names) against TP 1's (``one``): each tensor's max distance within ``rel`` of
    its largest entry, that floored at ``floor`` and at ``scale_floor`` times the model's largest gradient entry
    (the gradients that cancel to near zero differ by fp32 rounding of the larger terms). Prints the largest relative
    distance (``pytest -s``)."""
    assert one.keys() == two.keys()
    scale = max(float(g.double().abs().max()) for g in one.values())
    err = {n: float((two[n].double() - g.double()).abs().max()) for n, g in one.items()}
    den = {n: max(float(g.double().abs().max()), floor, scale_floor * scale) for n, g in one.items()}
    worst = max(one, key=lambda n: err[n] - rel * den[n])
    print("grads: the largest relative distance", max(err[n] / den[n] for n in one if den[n] > 0), "; worst against",
          rel, ":", worst)
    assert err[worst] <= rel * den[worst], (worst, err[worst], den[worst])


def check_parity(res: dict, *, lp_bound: float, metric_bound: float, update_bound: float | None = None,
                 rel_bound: float | None = None, metrics: tuple[str, ...] = METRICS, bf16: bool = True) -> None:
    """A ``parity_worker`` result: the export before training is the checkpoint (fp32; bf16 with ``bf16``),
    ``--save-hf`` and the torch_dist checkpoint round trips hold, the log-probs before training are within
    ``lp_bound``, the step ``metrics`` within ``metric_bound`` relative (to the value, or absolute below 1), and
    (with ``update_bound``) the update after 2 steps within ``update_bound`` (max abs) and ``rel_bound`` (relative
    L2). Prints the figures the bounds are set from (``pytest -s``)."""
    rel = max(abs(f[k] - m[k]) / max(1.0, abs(f[k])) for f, m in zip(res["fsdp_metrics"], res["meg_metrics"])
              for k in metrics)
    print("parity figures:", {k: res.get(k) for k in ("lp_max_abs_diff", "update_max_abs_diff", "update_rel_l2",
                                                     "update_max_abs")}, "metric_rel_max", rel)
    assert res["export_keys_equal"] and res["export_bitwise"], res
    assert not bf16 or res["export_bf16_bitwise"], res
    assert res["save_hf_equal"] and res["ckpt_reload_bitwise"] and res["resumed_extra"]["rollout_id"] == 1, res
    assert res["lp_max_abs_diff"] < lp_bound, res
    for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]):
        for key in metrics:
            assert abs(f[key] - m[key]) <= metric_bound * max(1.0, abs(f[key])), (key, f[key], m[key])
    if update_bound is not None:
        assert res["update_max_abs_diff"] < update_bound and res["update_rel_l2"] < rel_bound, res


def check_gpu_matches_hf(script: Path, model_dir, out: Path, port: int, label: str = "") -> dict:
    """``script``'s ``gpu`` worker (``gpu_worker``) on one GPU, checked by ``assert_bf16_parity``. Skips without
    a GPU."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    res = launch(script, 1, port, "gpu", model_dir, out)
    print(label, res)
    assert_bf16_parity(res)
    return res


def assert_bf16_parity(res: dict) -> None:
    """``gpu_worker``'s figures: Megatron's bf16 logits are as far from transformers' fp32 logits as transformers'
    own bf16 logits are, within a factor of 2 (both are bf16 roundings of the same function; a wrong layout gives
    > 1e-2 in fp32 already). Measured against fp32, not against transformers' bf16 logits: two independent bf16
    roundings are up to the sum of their errors apart."""
    assert res["max_abs_err_vs_fp32"] <= 2 * max(res["hf_bf16_vs_fp32"], 1e-3), res


def check_gpu_bf16_parity(res: dict) -> None:
    """A GPU parity result (``test_megatron._parity_worker``'s or ``test_megatron_moe``'s, both backends in bf16):
    the bounds of test_megatron.py's one-GPU parity test, about twice the one-H200 figures (2026-12-01, TP 1, bf16:
    log-probs 2.5e-3 apart, update 6.0% apart in relative L2): log-probs within 5e-3, the loss, pg_loss, entropy and
    gradient norm of each step within 5% (or 5e-3), the update within 12% (relative L2)."""
    import pytest

    assert res["lp_max_abs_diff"] < 5e-3, res
    for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]):
        for key in ("loss", "pg_loss", "entropy", "grad_norm"):
            assert m[key] == pytest.approx(f[key], rel=5e-2, abs=5e-3), (key, f[key], m[key])
    assert res["update_rel_l2"] < 0.12, res


def check_engine_greedy(model_dir: Path, log: Path, prompt: list[int], names: tuple[str, ...] = (), *,
                        values: bool = True) -> None:
    """``python -m miles.engine`` on ``model_dir`` (log ``log``) decodes ``prompt`` greedily (8 new tokens) to the
    tokens transformers' ``generate`` gives (``hf_lm``, fp32), and answers ``/get_weights_by_name`` (asked before it
    stops) for each of ``names`` (the checkpoint's names, which the trainers export): 200, and with ``values`` the
    checkpoint's tensor (``model.safetensors``), its first 100 entries (the route's default truncate_size 100)."""
    import torch
    from safetensors.torch import load_file

    from miles.engine.testing import EngineProc

    hf = hf_lm(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    eng = EngineProc(model_dir, "--max-running-requests", "2", "--max-context-len", "64", log=log)
    try:
        out = eng.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                                     "ignore_eos": True}})
        got = {n: eng.post("/get_weights_by_name", {"name": n}) for n in names}
    finally:
        eng.stop()
    assert out["output_ids"] == ref, (out["output_ids"], ref)
    disk = load_file(str(Path(model_dir) / "model.safetensors")) if values and names else {}
    for n, r in got.items():
        assert r.status_code == 200, (n, r.text)
        if values:
            assert torch.equal(torch.tensor(r.json()).to(disk[n].dtype), disk[n][:100]), n


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
