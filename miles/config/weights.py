"""Weight plane flags: how trained weights reach the engines."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

TRANSFER_MODES = ["broadcast", "p2p", "disk-delta", "tensor"]
DELTA_CHECKSUMS = ["xxh3-128", "blake3", "adler32"]


def _size(v: str) -> int:
    """Bytes, accepting 512MiB / 1GiB / 536870912."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    s = v.strip().lower()
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("weight sync")
    w.add_argument("--update-weight-transfer-mode", choices=TRANSFER_MODES, default="broadcast",
                   help="broadcast: trainer rank 0 broadcasts each bucket to every engine (with --colocate: the "
                        "same-device hand-off, as Miles). p2p: every trainer rank sends its own shard straight to the "
                        "engines (no gather). disk-delta: versions on a shared filesystem. tensor: the same-device "
                        "hand-off (needs --colocate).")
    w.add_argument("--update-weight-buffer-size", type=_size, default=512 << 20, help="Bucket size in bytes (e.g. 512MiB).")
    w.add_argument("--update-weight-disk-dir", type=str, default=None, help="Shared directory for disk-delta versions.")
    w.add_argument("--update-weight-delta-encoding", choices=["xor", "overwrite"], default="xor", help="Delta encoding.")
    w.add_argument("--update-weight-delta-checksum", choices=DELTA_CHECKSUMS, default="xxh3-128",
                   help="Per-tensor checksum of disk-delta versions: xxh3-128 (fast), blake3 (cryptographic), adler32.")
    w.add_argument("--update-weight-timeout", type=float, default=300.0, help="Seconds a whole weight sync may take.")
    w.add_argument("--update-weights-interval", type=int, default=1, help="Sync weights every N rollouts (async loop).")
    w.add_argument("--max-weight-staleness", type=int, default=None, help="Drop samples more than N versions old (async).")
    w.add_argument("--pause-generation-mode", choices=["abort", "retract", "in_place"], default="retract",
                   help="How engines pause for a weight update.")
    w.add_argument("--check-weight-update-equal", action="store_true", help="Compare engine weights to the trainer's after each sync.")
    w.add_argument("--lora-base-cpu-backup", action="store_true", default=False,
                   help="LoRA + --colocate (Miles's flag): the engines keep their frozen weights in host memory across "
                        "the colocated memory release (SGLang: --enable-weights-cpu-backup; the embedded engine always "
                        "does) and each weight sync after the first sends only the merged LoRA targets, not the frozen "
                        "rest. Megatron backend.")


@dataclass(kw_only=True)
class WeightSyncConfig:
    update_weight_transfer_mode: str
    update_weight_buffer_size: int
    update_weight_disk_dir: str | None
    update_weight_delta_encoding: str
    update_weight_delta_checksum: str
    update_weight_timeout: float
    update_weights_interval: int
    max_weight_staleness: int | None
    pause_generation_mode: str
    check_weight_update_equal: bool
    lora_base_cpu_backup: bool = False     # LoRA + colocate: syncs after the first send the merged targets only
