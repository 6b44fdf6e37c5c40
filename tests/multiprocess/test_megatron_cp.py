"""Context parallelism and sequence parallelism on the Megatron backend, on real gloo ranks (torchrun, CPU).

``test_cp_sp_parity_with_fsdp``: the FSDP backend (DP over the same ranks) and the Megatron backend with
``--context-parallel-size 2`` (each sequence split over 2 ranks, load-balanced chunks; ``--cp-comm-type``
p2p (= the all-gather algorithm), all_gather or a2a), with ``--sequence-parallel`` at TP 2, or both on 4
ranks, train the same 2 rollouts on samples of uneven lengths (5 to 16 tokens, rows padded to a multiple of
2 x CP); compared: every sample's log-probs before training, the step metrics and the parameter update, as
``test_megatron.py::test_trainer_parity_with_fsdp`` does (its worker runs here).

``test_cp_checkpoint_resume_matches_uninterrupted``: CP 2 with dropout, a rank SIGKILLed inside a save
(``kill_mid_save.py``) and relaunched, ends bitwise equal to an uninterrupted run.

``test_cp_not_dividing_ranks_is_one_line`` / ``test_bad_combination_is_one_line``: a CP size that does not
divide the trainer ranks, and flag combinations the backend does not run, are one ``ConfigError`` line naming
the flag and value. The ``gpu`` tests: the CP attention code against plain SDPA on one GPU (bf16, GQA), and
CP 2 parity on two GPUs (NCCL).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve()


def _launch(script_args: list[str], nproc: int, port: int, timeout: int = 600) -> subprocess.CompletedProcess:
    from _torchrun import torchrun_self

    return torchrun_self(HERE, nproc, port, *script_args, timeout=timeout)


CASES = {
    # id: (nproc, tp, untied, distributed optimizer, algo, Megatron flags)
    "cp2_p2p": (2, 1, False, False, "grpo", "--context-parallel-size,2"),
    "cp2_a2a_untied_ppo_critic_distributed_optimizer": (
        2, 1, True, True, "ppo", "--context-parallel-size,2,--cp-comm-type,a2a,--recompute-activations"),
    "tp2_sequence_parallel": (2, 2, False, False, "grpo", "--sequence-parallel"),
    "tp2_cp2_all_gather_sequence_parallel": (
        4, 2, False, False, "grpo", "--context-parallel-size,2,--cp-comm-type,all_gather,--sequence-parallel"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_sp_parity_with_fsdp(tiny_model_dir: Path, tmp_path: Path, free_port: int, case: str) -> None:
    import torch
    from test_megatron import PARITY_METRICS, parity_figures

    nproc, tp, untied, distopt, algo, mflags = CASES[case]
    model_dir = tiny_model_dir
    if untied:
        from miles.utils.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp_path / "untied", hidden_size=64, num_layers=2, tie_word_embeddings=False)
    out = tmp_path / "parity.pt"
    proc = _launch(["parity", str(model_dir), str(out), str(tp), "cpu", str(int(distopt)), algo, mflags], nproc,
                   free_port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    keys = PARITY_METRICS[algo]
    print(case, parity_figures(res, keys))
    assert res["distributed_optimizer"] == (distopt or nproc // tp > 1)   # on by default over DP x CP > 1, as Miles
    assert res["export_keys_equal"] and res["export_bitwise"] and res["save_hf_equal"], res
    # Bounds at about twice what was measured (2026-12-07, CPU fp32, the 2-core box; ``OMP_NUM_THREADS=1 python -m
    # pytest -s tests/multiprocess/test_megatron_cp.py -k test_cp_sp_parity_with_fsdp`` prints them; fp32 rounding
    # of another op order): log-probs 9.5e-7 (cp2_a2a, tp2_sequence_parallel), step metrics 1.2e-7 relative
    # (tp2_cp2), updates (up to 4.0e-3) 1.4e-5 apart, 1.5e-5 of the update's L2 norm (cp2_a2a), the critic's value
    # head 2.2e-8. Without the DP x CP gradient sum grad_norm is half the FSDP one, without the TP sum of the
    # sequence-parallel norms' gradients 4e-5 off (relative).
    assert res["lp_max_abs_diff"] < 2e-6, res
    for f, m in zip(res["fsdp_metrics"], res["meg_metrics"]):
        for key in keys:
            assert abs(f[key] - m[key]) <= 2.5e-7 * max(1.0, abs(f[key])), (key, f[key], m[key])
    assert res["update_max_abs_diff"] < 2.8e-5 and res["update_rel_l2"] < 3.1e-5, res
    if algo == "ppo":
        assert res["value_head_max_abs"] > 1e-3 and res["value_head_max_abs_diff"] < 4.5e-8, res


# ------------------------------------------------------------------------------------ checkpoints
def make_trainer(model_dir: str, flags: list[str], group):
    """CP 2 on the 2 ranks, dropout 0.1 (the RNG streams of both CP ranks are restored)."""
    from trainer_harness import build

    return build(model_dir, ["--train-backend", "megatron", "--context-parallel-size", "2", "--hidden-dropout",
                             "0.1"] + flags, group=group)


def test_cp_checkpoint_resume_matches_uninterrupted(tiny_model_dir: Path, tmp_path: Path) -> None:
    from kill_mid_save import kill_then_resume, reference

    from miles.trainer.checkpoint.layout import ITER

    ref = reference(HERE, tmp_path / "ref.pt", tiny_model_dir)
    kill_then_resume(HERE, tmp_path, ref, "shards", ITER, tiny_model_dir)


# ------------------------------------------------------------------------------------ the split itself
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_shard_rows_is_megatrons_load_balanced_split(cp: int) -> None:
    """CP rank i holds chunks i and 2cp-1-i; the ranks' columns partition the row; each response-predicting
    position is owned by exactly one rank, which finds it at ``local_index``; the sequence-order helpers of
    the attention invert each other."""
    import torch

    from miles.trainer.megatron import context_parallel as C

    b, s = 3, 12 * cp
    ids = torch.arange(b * s).view(b, s)
    pos = torch.arange(s).expand(b, s)
    index = torch.tensor([0, 5, s - 1, s + 2, 2 * s + s // 2, 2 * s + 1])          # flattened [b * s]
    seen, owners = [], torch.full((index.numel(),), -1)
    for r in range(cp):
        sh = C.shard_rows(ids, pos, index, r, cp)
        c = s // (2 * cp)
        assert sh.input_ids[0, :c].tolist() == list(range(r * c, (r + 1) * c))
        assert sh.input_ids[0, c:].tolist() == list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert torch.equal(sh.position_ids, sh.input_ids % s)
        assert torch.equal(sh.input_ids.reshape(-1)[sh.local_index], ids.reshape(-1)[index[sh.mine]])
        seen += sh.input_ids[0].tolist()
        owners[sh.mine] = r
        assert torch.equal(sh.owner, C.shard_rows(ids, pos, index, 0, cp).owner)
    assert sorted(seen) == list(range(s)) and bool((owners >= 0).all())
    x = torch.randn(2, 4, s, 3)
    rank_layout = torch.cat([x[:, :, C.chunk_columns(s, r, cp, x.device)] for r in range(cp)], dim=2)
    assert torch.equal(C._to_sequence_order(rank_layout, cp, 2), x)
    assert torch.equal(C._from_sequence_order(x, cp, 2), rank_layout)


# ------------------------------------------------------------------------------------ refusals
def _refusal_worker(model_dir: str, out: str, flag_sets: str) -> None:
    """Build a Megatron trainer with each ``;``-separated flag set on every rank; write one line per set
    (the ConfigError, or "ok")."""
    import torch.distributed as dist
    from trainer_harness import build

    from miles.config import ConfigError

    dist.init_process_group("gloo")
    lines = []
    for flags in flag_sets.split(";"):
        line = "ok"
        try:
            build(model_dir, ["--train-backend", "megatron", *flags.split(",")])
        except ConfigError as e:
            line = str(e).replace("\n", "<newline>")
        lines.append(line)
    if dist.get_rank() == 0:
        Path(out).write_text("\n".join(lines))
    dist.destroy_process_group()


NOT_DIVIDING = {     # on 2 trainer ranks
    "--context-parallel-size,3": "--context-parallel-size 3 does not divide the 2 trainer ranks",
    "--context-parallel-size,2,--tensor-model-parallel-size,2": "--context-parallel-size 2 does not divide the 2",
}


def test_cp_not_dividing_ranks_is_one_line(tiny_model_dir: Path, tmp_path: Path, free_port: int) -> None:
    out = tmp_path / "lines.txt"
    proc = _launch(["refuse", str(tiny_model_dir), str(out), ";".join(NOT_DIVIDING)], 2, free_port, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = out.read_text().split("\n")
    for (flags, expected), line in zip(NOT_DIVIDING.items(), lines, strict=True):
        assert expected in line and "<newline>" not in line, (flags, line)


REFUSED = {          # checked without a world, as the preflight and --dry-run do
    "--context-parallel-size,2,--cp-comm-type,a2a+p2p": "--cp-comm-type a2a+p2p (hierarchical",
    "--context-parallel-size,2,--attention-backend,unfused": "--attention-backend unfused",
    "--context-parallel-size,2,--cp-comm-type,p2p,a2a": "--cp-comm-type p2p a2a: one value per layer",
    # a2a splits a TP rank's heads over CP: 2 KV heads / TP 2 = 1 cannot be split over CP 2
    "--tensor-model-parallel-size,2,--context-parallel-size,2,--cp-comm-type,a2a": "2 attention heads and 1 KV heads",
}


@pytest.mark.parametrize("flags", list(REFUSED))
def test_bad_combination_is_one_line(tiny_model_dir: Path, flags: str) -> None:
    from transformers import AutoConfig

    from miles.config import ConfigError, parse_args
    from miles.trainer.megatron import options

    cfg = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
                      "--train-backend", "megatron", *flags.split(",")])
    shape = options.shape_of(AutoConfig.from_pretrained(tiny_model_dir))
    with pytest.raises(ConfigError) as e:
        options.check_static(options.resolve(cfg.megatron, cfg.train), shape)
    assert REFUSED[flags] in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sequence_parallel_at_tp1_is_accepted_and_does_nothing(tiny_model_dir: Path, monkeypatch) -> None:
    """Megatron-LM switches --sequence-parallel off at TP 1; here the value is kept as given (validation never
    rewrites values), it is accepted and one warning says it has no effect (the trainer builds its layers with
    ``sequence_parallel`` only for TP > 1: ``MegatronTrainer._sequence_parallel``)."""
    import torch
    from transformers import AutoConfig

    from miles.config import parse_args
    from miles.trainer.megatron import options

    cfg = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
                      "--train-backend", "megatron", "--sequence-parallel"])
    o = options.resolve(cfg.megatron, cfg.train)
    assert cfg.megatron.sequence_parallel and o.sequence_parallel and o.tp == 1
    shape = options.shape_of(AutoConfig.from_pretrained(tiny_model_dir))
    warned: list[str] = []
    monkeypatch.setattr(options, "warn_once", lambda logger, message: warned.append(message))
    options.check_supported(o, shape, torch.device("cpu"), 2)
    assert any("--sequence-parallel has no effect with --tensor-model-parallel-size 1" in w for w in warned), warned


# ------------------------------------------------------------------------------------ GPU
def _kernel_worker(out: str) -> None:
    """One rank on GPU 0 (NCCL): the CP attention code (a CP group of one rank holds chunks 0 and 1 of 2, so
    the all_gather path attends chunk 1 through the lower-right causal mask, the a2a path through its
    all-to-all) against plain causal SDPA, bf16 and GQA, forward and backward."""
    import json

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from miles.trainer.megatron import context_parallel

    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    b, heads, kv_heads, s, d = 2, 8, 2, 512, 64
    q, k, v = (torch.randn(b, n, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for n in (heads, kv_heads, kv_heads))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5, enable_gqa=True)
    grads_ref = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    res = {}
    for comm in ("all_gather", "a2a"):
        o = context_parallel.attention(q, k, v, comm=comm, group=dist.group.WORLD, scale=d ** -0.5)
        grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        res[comm] = {"out": float((o.float() - ref.float()).abs().max()), "scale": float(ref.float().abs().max()),
                     "grad": max(float((a.float() - r.float()).abs().max() / r.float().abs().max())
                                 for a, r in zip(grads, grads_ref))}
    Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.mark.gpu
def test_cp_attention_kernels_on_gpu(tmp_path: Path, free_port: int) -> None:
    import json

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "kernels.json"
    proc = _launch(["kernels", str(out)], 1, free_port, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    print(res)
    for comm, r in res.items():
        # bf16: ~3 significant digits; another kernel (masked memory-efficient vs flash) rounds differently
        assert r["out"] < 2e-2 * max(r["scale"], 1.0) and r["grad"] < 2e-2, (comm, r)


@pytest.mark.gpu
def test_cp2_parity_with_fsdp_on_two_gpus(tiny_model_dir: Path, tmp_path: Path, free_port: int) -> None:
    """2 GPUs (NCCL), bf16: Megatron CP 2 (TP 1) against the FSDP backend's DP 2, within bf16 rounding."""
    import torch
    from family_workers import check_gpu_bf16_parity

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    out = tmp_path / "parity_gpu.pt"
    proc = _launch(["parity_gpu", str(tiny_model_dir), str(out), "1", "cuda", "0", "grpo",
                    "--context-parallel-size,2"], 2, free_port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    assert res["bf16"] and res["export_keys_equal"] and res["export_bitwise"], res
    # Never run yet (2 GPUs): the bounds of test_megatron.py's one-GPU bf16 parity, about twice the one-GPU H200
    # figures (log-probs 2.5e-3, update 6.0%); ``pytest -s -m gpu`` on 2 GPUs prints what this run measures
    check_gpu_bf16_parity(res)


if __name__ == "__main__":
    if sys.argv[1] == "parity":
        from test_megatron import _parity_worker

        _parity_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6:7] == ["1"],
                       *sys.argv[7:9])
    elif sys.argv[1] == "parity_gpu":      # one GPU per rank, each seen as cuda:0 (the worker's device)
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]
        from test_megatron import _parity_worker

        _parity_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6:7] == ["1"],
                       *sys.argv[7:9])
    elif sys.argv[1] == "kill_mid_save":
        import kill_mid_save

        kill_mid_save.worker(make_trainer, *sys.argv[2:])
    elif sys.argv[1] == "kernels":
        _kernel_worker(sys.argv[2])
    elif sys.argv[1] == "refuse":
        _refusal_worker(sys.argv[2], sys.argv[3], sys.argv[4])
