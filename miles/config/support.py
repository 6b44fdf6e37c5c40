"""Which trainer backend honours which flag, and the flags accepted without being read (parse-only).

Every flag the parser accepts is honoured by both trainer backends, or refused in one line on the
backend that lacks it (``BACKEND_ONLY``, checked by ``check_backend_only``; the whole ``megatron``
section is refused on FSDP by ``MegatronConfig.validate``), or listed in ``PARSE_ONLY`` with the reason
accepting it and reading it nowhere is right (Miles's scripts pass it, and its value changes nothing
here, or every other value is refused). ``tests/unit/config/test_config_fields_read.py`` scans miles/
for the readers of every config field and holds the code to these tables; docs/flags.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.config.base import ConfigError, flag

if TYPE_CHECKING:
    from miles.config import MilesConfig

BACKENDS = ("fsdp", "megatron")
# config sections (MilesConfig fields) read by the trainer: their flags are held to both backends
TRAINER_SECTIONS = ("train", "algo", "checkpoint", "megatron")
# a section every flag of which only one backend takes (refused on the other by the section's own validate)
SECTION_BACKEND = {"megatron": "megatron"}


@dataclass(frozen=True)
class BackendOnly:
    backend: str      # the backend that honours the flag
    unset: Any        # its value when not given (any other value is refused on the other backend)
    instead: str      # what to do on the other backend


BACKEND_ONLY: dict[str, BackendOnly] = {
    "gradient_checkpointing": BackendOnly("fsdp", False, "use --recompute-activations (or --recompute-granularity "
                                                         "selective|full) instead"),
    "attn_implementation": BackendOnly("fsdp", "flash_attention_2", "drop it (the Megatron backend runs its own "
                                                                    "attention: --attention-backend)"),
    "fsdp_cpu_offload": BackendOnly("fsdp", False, "drop it (--offload-train moves the trainer's state to CPU while "
                                                   "the engines generate; --optimizer-cpu-offload moves AdamW)"),
    "qkv_format": BackendOnly("megatron", "thd", "drop it (the FSDP backend packs samples into variable-length "
                                                 "rows: thd)"),
    "megatron_to_hf_mode": BackendOnly("megatron", "raw", "drop it (the FSDP backend trains the HF model itself)"),
}

# field -> why the parser accepts it and no plane reads it
PARSE_ONLY: dict[str, str] = {
    "balance_data": "always on: every rollout is split over the data-parallel ranks in whole groups, longest first, "
                    "to the rank with the fewest tokens (both backends)",
    "attn_implementation": "FSDP backend: flash_attention_2 and flash_attention_3, the only values accepted, both "
                           "name what the FSDP trainer always runs (a flash varlen kernel on GPU, sdpa on CPU)",
    "qkv_format": "thd (the default) or, on the Megatron backend, bshd: it runs every micro-batch as right-padded "
                  "[b, s] rows either way (bshd, what Miles's gpt-oss script passes, names exactly that)",
    "lora_type": "only lora (the default) is accepted: fused q/k/v and gate/up adapters",
    "opd_teacher_ckpt_step": "refused when given: --opd-teacher-load is a HF directory here",
    "opd_topk_per_position": "refused when given: it needs a patched SGLang",
    "accumulate_allreduce_grads_in_fp32": "always on: the Megatron backend accumulates and reduces gradients in fp32",
    "attention_softmax_in_fp32": "always on: the Megatron backend's attention softmax runs in fp32",
    "use_rotary_position_embeddings": "Megatron-LM's older spelling of --position-embedding-type rope, the only "
                                      "position embedding the Megatron backend builds",
    "freeze_e_score_correction_bias": "the routers' expert bias (e_score_correction_bias) is never updated by the "
                                      "Megatron backend (--moe-router-bias-update-rate other than 0 is refused): it is "
                                      "frozen with or without the flag",
    "dsa_attention_backend": "megatron names the DeepSeek sparse attention the Megatron backend always runs (in "
                             "torch, unfused); tilelang is refused (miles/config/kernels.py: the tilelang package, "
                             "or its kernels, not wired here)",
    "enable_experimental": "Megatron-LM's gate of its experimental features; DeepSeek sparse attention is built from "
                           "config.json",
    "allgather_cp": "Miles's sequential CP layout of DeepSeek sparse attention; here the load-balanced chunks, DSA's "
                    "keys all-gathered over the CP group either way (the same values)",
    "data_pad_size_multiplier": "a padding of Miles's packed micro-batches for its kernels; rows are right-padded here "
                                "and padding changes no log-prob",
    "rematerialize_param_from_master_weight": "a host-memory saving of Miles's offload; the weights after an onload "
                                              "are the same either way",
    "ckpt_format": "only torch_dist (Megatron-LM's default, what the Megatron backend writes) is accepted",
    "overlap_cpu_optimizer_d2h_h2d": "a hint: with --optimizer-cpu-offload the copies are non-blocking already",
    "use_precision_aware_optimizer": "AdamW state and master weights are fp32 either way",
    "moe_enable_deepep": "needs --moe-token-dispatcher-type flex, which the Megatron backend refuses (DeepEP's "
                         "dispatcher is not wired in yet); where DeepEP (deep_ep) does not import, refused naming it",
}


def check_backend_only(cfg: MilesConfig) -> None:
    """Refuse a ``BACKEND_ONLY`` flag given under the other backend: one line naming flag, value and backend."""
    backend = cfg.train.train_backend
    for name, only in BACKEND_ONLY.items():
        value = _field(cfg, name)
        if only.backend == backend or value == only.unset:
            continue
        shown = flag(name) if value is True else f"{flag(name)} {value}"
        raise ConfigError(f"{shown} is not supported by --train-backend {backend} (only by --train-backend "
                          f"{only.backend}): {only.instead}.")


def _field(cfg: MilesConfig, name: str) -> Any:
    for section in TRAINER_SECTIONS:
        obj = getattr(cfg, section)
        if hasattr(obj, name):
            return getattr(obj, name)
    raise KeyError(f"BACKEND_ONLY names {name!r}, a field of no trainer section")


def flag_docs() -> list[str]:
    """The docs/flags.md section for these tables (tools/gen_flag_docs.py)."""
    lines = ["## Flags of one trainer backend", "",
             "Refused in one line under the other `--train-backend` when given (a value other than the default); "
             "every `--train-backend megatron` group flag is refused under fsdp the same way.", "",
             "| flag | backend | on the other backend |", "|---|---|---|"]
    lines += [f"| `{flag(n)}` | {o.backend} | {o.instead} |" for n, o in BACKEND_ONLY.items()]
    lines += ["", "## Flags accepted and read nowhere", "",
              "Kept because Miles's scripts pass them; each is a no-op here for the reason given (or every value "
              "but the default is refused).", "", "| flag | why |", "|---|---|"]
    lines += [f"| `{flag(n)}` | {why} |" for n, why in PARSE_ONLY.items()]
    return lines + [""]
