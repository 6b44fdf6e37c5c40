"""Adapters synced instead of merged weights (``--sglang-enable-lora`` with ``--lora-rank``, as Miles syncs LoRA):
which runs select it, its refusal on the transports without an adapter path (disk-delta, p2p: one line, at
preflight and when the sender is built), and which buckets each sync sends (the unmerged base; with ``--lora-base-cpu-backup`` only the first time).

End to end (a Megatron LoRA run whose colocated embedded engines serve the adapter, against the same run syncing
merged weights): tests/e2e/test_lora_adapter_sync_e2e.py."""

from __future__ import annotations

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.config.sglang import serves_lora_adapters
from miles.run.preflight import check_lora_adapter_sync
from miles.weight_sync.base import SyncResult, WeightSender, build_weight_sender

LORA = ["--lora-rank", "4", "--target-modules", "all-linear", "--train-backend", "megatron"]


def _cfg(*flags: str):
    return parse_args(["--hf-checkpoint", "x", "--num-rollout", "1", "--rollout-batch-size", "2", *flags],
                      validate=False)


def test_which_runs_serve_adapters_and_the_refusal_off_colocated():
    assert serves_lora_adapters(_cfg(*LORA, "--sglang-enable-lora").train, _cfg(*LORA, "--sglang-enable-lora").sglang)
    assert not serves_lora_adapters(_cfg(*LORA).train, _cfg(*LORA).sglang)            # merged weights, as before
    plain = _cfg("--sglang-enable-lora")                 # engines that serve adapters, but nothing trains one
    assert not serves_lora_adapters(plain.train, plain.sglang)
    check_lora_adapter_sync(_cfg(*LORA, "--sglang-enable-lora", "--colocate"))           # tensor
    check_lora_adapter_sync(_cfg(*LORA, "--sglang-enable-lora"))                         # broadcast
    check_lora_adapter_sync(_cfg(*LORA))
    msg = (r"^--sglang-enable-lora with --lora-rank syncs the LoRA adapters to the engines, which is built for the "
           r"tensor \(colocated: load_lora_adapter_from_tensors\) and broadcast \(load_lora_adapter_from_distributed\) "
           r"transports; --update-weight-transfer-mode disk-delta is not: use broadcast \(or --colocate\), or drop "
           r"--sglang-enable-lora to sync merged weights\.$")
    disk = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/tmp/d"]
    with pytest.raises(ConfigError, match=msg):
        check_lora_adapter_sync(_cfg(*LORA, "--sglang-enable-lora", *disk))
    with pytest.raises(ConfigError, match=msg.replace("$", "").replace("disk-delta", "p2p")):
        check_lora_adapter_sync(_cfg(*LORA, "--sglang-enable-lora", "--update-weight-transfer-mode", "p2p"))
    with pytest.raises(ConfigError, match=msg):
        build_weight_sender(_cfg(*LORA, *disk).weights, _Source(), is_source=True, lora_adapter=True)


class _Source:
    """A trainer stand-in: its merged export differs from its base (a trained adapter)."""

    def iter_weight_buckets(self, bucket_bytes, dtype=None):
        yield [("w.weight", torch.ones(2))]

    def iter_base_weight_buckets(self, bucket_bytes, dtype=None):
        yield [("w.weight", torch.zeros(2))]

    def iter_trained_weight_buckets(self, bucket_bytes, dtype=None):
        yield [("w.weight", torch.ones(2))]


class _Recording(WeightSender):
    mode = "tensor"

    def __init__(self, cfg, source, mode: str = "tensor"):
        self.mode = mode
        super().__init__(cfg, source, is_source=True, lora_adapter=True)
        self.sent: list[list[float]] = []

    def _sync(self, engines, version):
        self.sent.append([float(t.sum()) for bucket in self.iter_buckets() for _, t in bucket])
        return SyncResult(self.mode, version)


def test_adapter_syncs_send_the_unmerged_base():
    s = _Recording(_cfg(*LORA, "--colocate").weights, _Source())
    s.sync()
    s.sync()
    assert s.sent == [[0.0], [0.0]]                     # the base every time: a colocated engine may drop it
    s = _Recording(_cfg(*LORA, "--colocate", "--lora-base-cpu-backup").weights, _Source())
    s.sync()
    s.sync()
    s.sync_one(None)
    assert s.sent == [[0.0], [], [0.0]]                 # the engines keep the base: later syncs the adapter only
    assert [float(t.sum()) for b in s.iter_buckets(full=True) for _, t in b] == [0.0]   # what the check compares
    s = _Recording(_cfg(*LORA).weights, _Source(), mode="broadcast")      # separate engines keep their base
    s.sync()
    s.sync()
    s.sync_one(None)
    assert s.sent == [[0.0], [], [0.0]]


def test_adapter_serving_with_fault_tolerance_is_refused():
    with pytest.raises(ConfigError, match=r"^--sglang-enable-lora with --lora-rank and --use-fault-tolerance is not "
                                          r"supported"):
        parse_args(["--hf-checkpoint", "x", "--num-rollout", "1", "--rollout-batch-size", "2", *LORA, "--colocate",
                    "--sglang-enable-lora", "--use-fault-tolerance"])


def test_serving_limits_the_adapter_must_fit_are_checked_before_start():
    """The engines would refuse the trained adapter only at the first weight sync (after they started): a
    --sglang-max-lora-rank below --lora-rank, a --sglang-max-loaded-loras without room for it, and the fully async
    rollout (its requests name the adapter while a sync replaces it) are one line at parse time."""
    base = ["--hf-checkpoint", "x", "--num-rollout", "1", "--rollout-batch-size", "2", *LORA, "--colocate",
            "--sglang-enable-lora"]
    with pytest.raises(ConfigError, match=r"^--sglang-max-lora-rank 2 is below --lora-rank 4: .*--sglang-max-lora-rank "
                                          r"4 or more"):
        parse_args(base + ["--sglang-max-lora-rank", "2"])
    parse_args(base + ["--sglang-max-lora-rank", "4"])
    with pytest.raises(ConfigError, match=r"^--sglang-max-loaded-loras 1 leaves no room for the trained adapter beside "
                                          r"the 1 of --sglang-lora-paths; give --sglang-max-loaded-loras 2 or more"):
        parse_args(base + ["--sglang-max-loaded-loras", "1", "--sglang-lora-paths", "other=/tmp/other"])
    parse_args(base + ["--sglang-max-loaded-loras", "1"])
    with pytest.raises(ConfigError, match=r"^--sglang-enable-lora with --lora-rank and the fully async rollout is not "
                                          r"supported"):
        parse_args([f for f in base if f != "--colocate"] + ["--fully-async"], is_async=True)
    parse_args([f for f in base if f != "--colocate"], is_async=True)   # train_async.py, not fully async: accepted


def test_engine_shared_outer_needs_the_trainers():
    """Miles's rule: the engines' shared-outer expert adapters (--sglang-experts-shared-outer-loras) need the trainer's
    layout (--experts-shared-outer-loras); one line otherwise."""
    flags = ["--hf-checkpoint", "x", "--num-rollout", "1", "--rollout-batch-size", "2", *LORA, "--colocate",
             "--sglang-enable-lora", "--sglang-experts-shared-outer-loras"]
    with pytest.raises(ConfigError, match=r"^--sglang-experts-shared-outer-loras with --sglang-enable-lora serves MoE "
                                          r"experts' adapters whose outer factors are shared, but the trainer's are "
                                          r"per expert; add --experts-shared-outer-loras"):
        parse_args(flags)
    parse_args(flags + ["--experts-shared-outer-loras"])


def test_embedded_engine_takes_adapters_on_moe_experts(tiny_moe_dir, tiny_model_dir):
    """The embedded engine serves adapters on MoE experts too (miles.engine.lora_experts): a Megatron LoRA run adapting
    the routed experts with --sglang-enable-lora (per-expert or shared-outer) passes the engine's checks."""
    from miles.run.preflight import check_engine_kind

    def cfg(model, targets, *extra):
        return _cfg("--hf-checkpoint", str(model), "--lora-rank", "4", "--target-modules", targets,
                    "--train-backend", "megatron", "--colocate", "--sglang-enable-lora", *extra)
    for kind in ("embedded", "sglang"):
        check_engine_kind(cfg(tiny_moe_dir, "all-linear"), kind)
        check_engine_kind(cfg(tiny_moe_dir, "all-linear", "--experts-shared-outer-loras",
                              "--sglang-experts-shared-outer-loras"), kind)
    check_engine_kind(cfg(tiny_moe_dir, "q_proj,v_proj"), "embedded")       # attention only
    check_engine_kind(cfg(tiny_model_dir, "all-linear"), "embedded")        # a dense model


def test_plugins_name_the_adapter_only_when_the_engines_serve_it():
    """Miles's ``miles.utils.lora.lora_rollout_enabled`` (plugins put ``lora_path`` in their own /generate bodies when
    it holds, e.g. ``prefill_logprobs``) follows ``serves_lora_adapters``: engines holding merged weights know no
    adapter, so a LoRA run without --sglang-enable-lora names none."""
    from miles.rollout.plugins import PluginArgs
    from miles.run.build import plugin_extra
    from miles.utils.lora import lora_rollout_enabled

    for extra, serves in (([], False), (["--sglang-enable-lora"], True)):
        c = _cfg(*LORA, *extra)
        assert lora_rollout_enabled(PluginArgs(c.rollout, c.data, c.train, extra=plugin_extra(c))) is serves
        assert serves_lora_adapters(c.train, c.sglang) is serves
