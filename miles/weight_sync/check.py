"""``--check-weight-update-equal``: after a sync, every engine's weights equal the trainer's, bitwise.

Collective on every trainer rank (the trainer's buckets are gathered once more, in lockstep); the source
rank asks every engine for each tensor through ``/get_weights_by_name`` (``truncate_size`` = the first
dimension, i.e. the whole tensor) and compares the values bit for bit in the trainer's (sent) dtype.
JSON numbers are float64, which represents every bf16/fp16/fp32 value exactly, so the comparison is
exact. A mismatch raises :class:`WeightSyncError` naming the engine and the tensor.

The multi-token-prediction layers a trainer exports with ``--mtp-num-layers`` (``model.layers.<num_layers + k>.*``,
the source's optional ``mtp_weight_prefixes()``) are not compared: an engine's served model is the main model
(SGLang reads them only into the draft model of speculative decoding, and skips them without it; the embedded
engine skips them on load), so the check skips them and says so once, with their count.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from miles.utils.logging import get_logger
from miles.weight_sync.base import Deadline, WeightSender, WeightSyncError

logger = get_logger(__name__)


def _engine_values(resp: Any, name: str, url: str) -> Any:
    if isinstance(resp, dict):  # tolerate {"data": [...]}/{"weights": [...]} envelopes
        for key in ("data", "weights", "weight", "values"):
            if key in resp:
                return resp[key]
        raise WeightSyncError(f"--check-weight-update-equal: engine {url} answered /get_weights_by_name({name!r}) with {str(resp)[:200]}")
    return resp


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def compare(name: str, expected: torch.Tensor, got: Any, url: str) -> None:
    """Raise naming ``name`` unless ``got`` (JSON values) equals ``expected`` bitwise."""
    try:
        engine = torch.tensor(got, dtype=torch.float64)
    except (TypeError, ValueError) as e:
        raise WeightSyncError(f"--check-weight-update-equal: engine {url} returned non-numeric values for {name!r}: {e}") from e
    exp = expected.detach().to("cpu")
    if engine.numel() != exp.numel():
        raise WeightSyncError(f"--check-weight-update-equal: engine {url} tensor {name!r} has {engine.numel()} elements "
                              f"(shape {list(engine.shape)}), the trainer's has {exp.numel()} (shape {list(exp.shape)})")
    engine = engine.reshape(exp.shape).to(exp.dtype)
    if not torch.equal(_bits(engine), _bits(exp)):
        diff = (engine.double() - exp.double()).abs()
        bad = int((_bits(engine).reshape(exp.numel(), -1) != _bits(exp).reshape(exp.numel(), -1)).any(dim=1).sum()) if exp.numel() else 0
        raise WeightSyncError(f"--check-weight-update-equal: engine {url} tensor {name!r} differs from the trainer's: "
                              f"{bad}/{exp.numel()} elements, max |diff| {float(diff.max()) if diff.numel() else 0.0:.3g}")


_SKIP_LOGGED: set[tuple[str, ...]] = set()


def mtp_prefixes(source: Any) -> tuple[str, ...]:
    """The HF name prefixes of the MTP layers ``source`` exports (its optional ``mtp_weight_prefixes()``), or ()."""
    get = getattr(source, "mtp_weight_prefixes", None)
    return tuple(get()) if callable(get) else ()


def check_weights_equal(sender: WeightSender) -> int:
    """Compare every engine's weights with the trainer's; returns the number of tensors checked (source). The
    exported MTP layers' tensors are skipped (module docstring), logged once."""
    skip = mtp_prefixes(sender.source)
    skipped = 0
    deadline = Deadline(sender.cfg.update_weight_timeout, "--check-weight-update-equal")
    engines = list(sender.engines) if sender.is_source else []
    checked = 0
    t0 = time.monotonic()
    failure: WeightSyncError | None = None
    for bucket in sender.iter_buckets(full=True):  # every rank, in lockstep; every tensor, sent this time or not
        if not engines or failure is not None:
            continue
        for name, t in bucket:
            if skip and name.startswith(skip):
                skipped += 1
                continue
            size = int(t.shape[0]) if t.dim() else 1
            try:
                answers = sender.call_all(engines, lambda c, n=name, s=size: c.get_weights_by_name(n, truncate_size=s), deadline,
                                          f"get_weights_by_name({name!r})")
                for e, ans in zip(engines, answers):
                    compare(name, t, _engine_values(ans, name, e.url), e.url)
            except WeightSyncError as e:
                failure = e
                break
            checked += 1
    if failure is not None:
        raise failure
    if skipped and skip not in _SKIP_LOGGED:
        _SKIP_LOGGED.add(skip)
        logger.warning("--check-weight-update-equal: skipped the %d exported tensors of the MTP layers (%s*, "
                       "--mtp-num-layers): the engines serve the main model without them (SGLang reads them only "
                       "into a speculative-decoding draft model, the embedded engine not at all)", skipped,
                       "*, ".join(skip))
    if engines:
        logger.info("--check-weight-update-equal: %d tensors equal on %d engine(s) (v%d) in %.2fs", checked, len(engines),
                    sender.weight_version, time.monotonic() - t0)
    return checked
