"""``--lora-base-cpu-backup`` (Miles's flag; LoRA with colocated engines): the flag's refusals, the SGLang engines'
``--enable-weights-cpu-backup``, which buckets each sync sends (``WeightSender.sync``: the first sync and
``sync_one`` everything, the later ones the trained tensors only, the equality check everything).

End to end (Megatron LoRA, a colocated embedded engine that releases and resumes its weights between rollouts,
``--check-weight-update-equal`` comparing every tensor after each partial sync): the replay of Miles's Qwen3.5 LoRA
command, tests/e2e/test_miles_replay.py (``lora_qwen3_5_35b_a3b``)."""

from __future__ import annotations

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.config.unsupported import unsupported_message
from miles.fleet.engines import weight_backup_server_flags
from miles.weight_sync.base import SyncResult, WeightSender

LORA = ["--lora-rank", "4", "--target-modules", "all-linear", "--train-backend", "megatron"]


def test_flag_needs_lora_colocate_and_the_megatron_backend(tiny_model_dir):
    base = ["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "2"]
    cfg = parse_args(base + LORA + ["--colocate", "--lora-base-cpu-backup"])
    assert cfg.weights.lora_base_cpu_backup and not parse_args(base + LORA + ["--colocate"]).weights.lora_base_cpu_backup
    assert unsupported_message("--lora-base-cpu-backup") is None
    for argv, msg in ((["--colocate"], r"^--lora-base-cpu-backup without --lora-rank"),
                      (LORA, r"^--lora-base-cpu-backup without --colocate"),
                      (LORA[:-2] + ["--train-backend", "fsdp", "--colocate"],
                       r"^--lora-base-cpu-backup with --train-backend fsdp"),
                      (LORA + ["--colocate", "--use-fault-tolerance"],
                       r"^--lora-base-cpu-backup with --use-fault-tolerance")):
        with pytest.raises(ConfigError, match=msg):
            parse_args(base + argv + ["--lora-base-cpu-backup"])
    assert weight_backup_server_flags("sglang", cfg.weights) == ["--enable-weights-cpu-backup"]
    assert weight_backup_server_flags("embedded", cfg.weights) == []       # it always keeps released weights on host
    assert weight_backup_server_flags("sglang", parse_args(base + LORA + ["--colocate"]).weights) == []


class _Source:
    """A trainer stand-in: a frozen tensor and a trained one."""

    def __init__(self) -> None:
        self.tensors = {"frozen.weight": torch.zeros(3), "trained.weight": torch.ones(2)}

    def iter_weight_buckets(self, bucket_bytes, dtype=None):
        yield list(self.tensors.items())

    def iter_trained_weight_buckets(self, bucket_bytes, dtype=None):
        yield [("trained.weight", self.tensors["trained.weight"])]


class _Recording(WeightSender):
    mode = "recording"

    def __init__(self, cfg, source, fail: bool = False):
        super().__init__(cfg, source, is_source=True)
        self.sent: list[list[str]] = []
        self.fail = fail

    def _sync(self, engines, version):
        names = [n for bucket in self.iter_buckets() for n, _ in bucket]
        if self.fail:
            self.fail = False
            raise RuntimeError("engine gone")
        self.sent.append(names)
        return SyncResult(self.mode, version)


def _weights(*flags: str):
    return parse_args(["--hf-checkpoint", "x", *flags], validate=False).weights


def test_syncs_after_the_first_send_the_trained_tensors_only():
    s = _Recording(_weights("--lora-base-cpu-backup"), _Source())
    s.sync()
    r = s.sync()
    s.sync_one(None)
    s.sync()
    assert s.sent == [["frozen.weight", "trained.weight"], ["trained.weight"], ["frozen.weight", "trained.weight"],
                      ["trained.weight"]]
    assert r.extra["trained_only"] == 1.0 and s.weight_version == 3
    assert [n for b in s.iter_buckets(full=True) for n, _ in b] == ["frozen.weight", "trained.weight"]
    plain = _Recording(_weights(), _Source())
    plain.sync()
    plain.sync()
    assert plain.sent == [["frozen.weight", "trained.weight"]] * 2


def test_a_failed_first_sync_is_sent_whole_again():
    s = _Recording(_weights("--lora-base-cpu-backup"), _Source(), fail=True)
    with pytest.raises(Exception, match="engine gone"):
        s.sync()
    s.sync()
    s.sync()
    assert s.sent == [["frozen.weight", "trained.weight"], ["trained.weight"]]
