"""Miles's ``miles.backends.training_utils.cp_utils``: the two context-parallel helpers its loss plugins call
(Miles's ``examples/infra_features/train_infer_mismatch_helper/mis.py``, ``compute_mis_weights_with_cp``).

    full = all_gather_with_cp(log_probs_i, total_length, response_length, qkv_format, max_seq_len)   # [R_i]
    local = slice_log_prob_with_cp(values_i, total_length, response_length, qkv_format, max_seq_len)

In Miles a loss function on a context-parallel rank holds only that rank's chunks of each response, so a
plugin gathers them to the whole response and slices its per-token results back. Here the shared loss
(:mod:`miles.trainer.losses`) always sees every response whole, on every rank: with
``--context-parallel-size N`` the Megatron backend reassembles the log-probs over the CP group before the loss
(:mod:`miles.trainer.megatron.context_parallel`). So for a plugin both helpers are what Miles's are at
context-parallel size 1: the values come back as they are, after a check that they hold one entry per
response token. Only ``thd`` (packed rows) is accepted, as ``--qkv-format`` is.
"""

from __future__ import annotations

from typing import Any

__all__ = ["all_gather_with_cp", "slice_log_prob_with_cp"]


def _whole(values: Any, total_length: int, response_length: int, qkv_format: str, what: str) -> None:
    if qkv_format != "thd":
        raise ValueError(f"{what}: qkv_format {qkv_format!r} is not supported; miles packs samples (--qkv-format thd).")
    if not 0 <= response_length <= total_length:
        raise ValueError(f"{what}: response_length {response_length} must be in [0, total_length {total_length}].")
    if len(values) != response_length:
        raise ValueError(f"{what}: got {len(values)} values for a response of {response_length} tokens; the loss "
                         "holds each response whole (one value per response token).")


def all_gather_with_cp(tensor: Any, total_length: int, response_length: int, qkv_format: str = "thd",
                       max_seq_len: int | None = None) -> Any:
    """The whole response's per-token values [R] from this rank's: here they are already whole (module doc)."""
    _whole(tensor, total_length, response_length, qkv_format, "all_gather_with_cp")
    return tensor


def slice_log_prob_with_cp(log_prob: Any, total_length: int, response_length: int, qkv_format: str = "thd",
                           max_token_len: int | None = None) -> Any:
    """This rank's part of a whole response's per-token values (a list or a tensor): here all of them."""
    _whole(log_prob, total_length, response_length, qkv_format, "slice_log_prob_with_cp")
    return log_prob
