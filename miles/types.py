"""Types shared by the planes (plain data, no behaviour beyond convenience)."""

from __future__ import annotations

import base64
import inspect
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from miles.utils.errors import MilesError


class SampleError(MilesError, ValueError, AssertionError):
    """A plugin asked a ``Sample`` for what it cannot do (strip more tokens than its response has); one line. A
    ValueError (a bad argument) and an AssertionError too: Miles v0.1.0's ``Sample`` checks with ``assert``, and
    Miles's tests and plugins expect that type."""


class SampleStatus(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"      # finished by stop token / stop string
    TRUNCATED = "truncated"      # hit max_new_tokens
    ABORTED = "aborted"          # aborted by the engine or the manager (not trained on)
    FAILED = "failed"            # reward or generation failed (counted, not trained on)


@dataclass(frozen=True)
class RewardSpec:
    """Miles's per-sample scoring spec (``sample.reward_spec``): set fields win over ``metadata["rm_type"]`` and the
    ``--rm-type`` / ``--custom-rm-path`` flags when the sample is scored."""

    rm_type: str | None = None
    custom_rm_path: str | None = None


@dataclass
class PrefixCacheInfo:
    """Miles's ``Sample.PrefixCacheInfo``: the prompt tokens the engines found in their prefix cache, added up over a
    sample's /generate answers (their ``meta_info`` ``cached_tokens`` / ``prompt_tokens``)."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

    def add(self, meta_info: dict[str, Any]) -> None:
        """Add one answer's counts (a count that is absent or not a number adds nothing)."""
        def count(key: str) -> int:
            v = meta_info.get(key)
            return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0

        self.cached_tokens += count("cached_tokens")
        self.total_prompt_tokens += count("prompt_tokens")

    def to_dict(self) -> dict[str, int]:
        return {"cached_tokens": self.cached_tokens, "total_prompt_tokens": self.total_prompt_tokens}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> PrefixCacheInfo:
        return PrefixCacheInfo(int(data.get("cached_tokens", 0)), int(data.get("total_prompt_tokens", 0)))


# per-token lists a sample may carry in its metadata (one value per response token), cut with the response
PER_TOKEN_METADATA = ("teacher_log_probs", "opd_reverse_kl", "opd_student_top_logprobs")


@dataclass
class Sample:
    """One prompt-response pair, as it travels from the rollout manager to the trainer.

    ``tokens`` is prompt + response token ids exactly as the engine saw and produced them
    (token-in-token-out); ``loss_mask`` has one entry per response token (1: trained on, 0: e.g. a
    tool's output inside a multi-turn response).
    """

    group_index: int = 0
    index: int = 0
    rollout_id: int = 0
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    label: Any = None
    reward: float | None = None
    rollout_log_probs: list[float] | None = None
    # R3 (--use-rollout-routing-replay): the engine's meta_info["routed_experts"] as SGLang sends it, base64 of int32
    # [len(tokens) - 1, num_hidden_layers, top-k] (the experts every token but the last was routed to); Miles's field
    # name. Kept encoded (JSON-safe, compact) until the trainer reads it (miles.trainer.routing_replay).
    rollout_routed_experts: str | None = None
    # Miles's field for DeepSeek-V3.2's indexer replay (--use-rollout-indexer-replay, refused here): the indexer's
    # top-k of every token but the last, [len(tokens) - 1, indexer layers, index top-k] int32, as a plugin sets it.
    # Kept on the rollout side (cut by strip_last_output_tokens), not sent to the trainer: no model here has an indexer.
    rollout_indexer_topk: Any = None
    weight_version: int | None = None
    # Miles's fields: the engine's weight_version of each /generate turn (as the engine reports it), and a
    # sample a plugin marks to keep in its group but not train on (its loss mask becomes all zeros, as in Miles)
    weight_versions: list[str] = field(default_factory=list)
    remove_sample: bool = False
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    reward_spec: RewardSpec | None = None   # Miles's: how this sample is scored (None: the flags)
    # Miles's field: sent as sglang-router's ``X-SMG-Routing-Key`` header with each of this sample's /generate
    # requests (the router's ``manual`` policy sends every request of one key to the same engine). Under
    # ``--sglang-router-policy manual`` the rollout gives each sample without one a fresh key, as Miles does. Kept on
    # the rollout side: the sample wire does not carry it (Miles's trainer does not get it either).
    routing_key: str | None = None

    Status = SampleStatus  # Miles's spelling: ``Sample.Status.ABORTED``
    PrefixCacheInfo = PrefixCacheInfo  # Miles's spelling: ``Sample.PrefixCacheInfo``

    @property
    def prefix_cache_info(self) -> PrefixCacheInfo:
        """Miles's field: the engines' prefix-cache hits over this sample's answers (the rollout adds each answer's;
        plugins may ``.add(meta_info)``). Not a dataclass field: it stays on the rollout side."""
        return self.__dict__.setdefault("_prefix_cache_info", PrefixCacheInfo())

    @prefix_cache_info.setter
    def prefix_cache_info(self, value: PrefixCacheInfo) -> None:
        self.__dict__["_prefix_cache_info"] = value

    @property
    def multimodal_inputs(self) -> dict[str, Any] | None:
        """Miles's field: the sample's raw media, ``{"images": [PIL RGB images], "videos": None}`` in prompt order,
        None for a sample without images. Loaded on first read from the references in ``metadata["multimodal_inputs"]``
        (``--multimodal-keys``), where Miles's data loader puts the images; a plugin may assign it or extend its
        ``images`` in place (Miles's multi-turn geo3k example adds each observation's images). Whatever it holds is
        written back as references (:meth:`store_multimodal_inputs`: an image read from a reference keeps it, a new
        one becomes a PNG data URI) before the sample's next request and when its generate function returns, so the
        engines get, and each trainer rank recomputes the pixels of, exactly these images. Videos and other media
        are refused there (one line). Not a dataclass field: the PIL images stay on the rollout side."""
        if "_multimodal_inputs" not in self.__dict__:
            from miles.utils.images import raw_inputs

            self.__dict__["_multimodal_inputs"], self.__dict__["_multimodal_loaded"] = raw_inputs(self.metadata)
        return self.__dict__["_multimodal_inputs"]

    @multimodal_inputs.setter
    def multimodal_inputs(self, value: dict[str, Any] | None) -> None:
        self.__dict__["_multimodal_inputs"] = value

    def store_multimodal_inputs(self) -> None:
        """Write :attr:`multimodal_inputs`, once read or set, back to ``metadata["multimodal_inputs"]["images"]`` as
        references (what the requests and the trainer read); SampleError (one line) for media the trainer cannot
        take. Without a read or an assignment nothing changes."""
        if "_multimodal_inputs" not in self.__dict__:
            return
        from miles.utils.images import MEDIA_KEY, inputs_refs, sample_images

        try:
            refs = inputs_refs(self.__dict__["_multimodal_inputs"], self.__dict__.get("_multimodal_loaded", []))
        except ValueError as e:
            raise SampleError(f"sample {self.index}: {e}") from None
        if refs or sample_images(self.metadata):
            media = self.metadata.get(MEDIA_KEY)
            self.metadata[MEDIA_KEY] = {**(media if isinstance(media, dict) else {}), "images": refs}

    @property
    def multimodal_train_inputs(self) -> dict[str, Any] | None:
        """Miles's field: the image processor's outputs of the sample's images (``pixel_values``,
        ``image_grid_thw``), None for a text sample; computed on first read from ``metadata["multimodal_inputs"]``
        (``miles.utils.images.train_inputs``; after :attr:`multimodal_inputs` is stored), settable by plugins. Not a
        dataclass field: it stays on the rollout side; the trainer recomputes the pixels from the image references
        the sample carries."""
        if "_multimodal_train_inputs" not in self.__dict__:
            from miles.utils.images import train_inputs

            self.store_multimodal_inputs()

            self.__dict__["_multimodal_train_inputs"] = train_inputs(self.metadata)
        return self.__dict__["_multimodal_train_inputs"]

    @multimodal_train_inputs.setter
    def multimodal_train_inputs(self, value: dict[str, Any] | None) -> None:
        self.__dict__["_multimodal_train_inputs"] = value

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def get_reward_value(self, args: Any) -> Any:
        """Miles's accessor: the reward, or its ``--reward-key`` entry when the reward is a dict."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward

    def validate(self) -> None:
        """Miles's check that the per-token fields agree with ``response_length``: ``loss_mask``,
        ``rollout_log_probs``, ``metadata["teacher_log_probs"]`` / ``["opd_reverse_kl"]`` one entry per response token,
        a routed-experts or indexer array (as a plugin sets it) one row per token but the last. The first that does
        not raises SampleError (a ValueError and, as Miles's ``assert``, an AssertionError), one line. The engine's
        base64 routed experts are checked by the trainer, which knows the model's layers and top-k."""
        if not 0 <= self.response_length <= len(self.tokens):
            raise SampleError(f"response_length {self.response_length} must be between 0 and len(tokens) "
                              f"{len(self.tokens)}")
        lists = {name: getattr(self, name) for name in ("loss_mask", "rollout_log_probs")}
        meta = self.metadata if isinstance(self.metadata, dict) else {}
        lists.update({f"metadata[{key!r}]": meta.get(key) for key in ("teacher_log_probs", "opd_reverse_kl")})
        for name, v in lists.items():
            if hasattr(v, "__len__") and len(v) != self.response_length:
                raise SampleError(f"{name} has {len(v)} entries, expected response_length {self.response_length}")
        for name in ("rollout_routed_experts", "rollout_indexer_topk"):
            v = getattr(self, name)
            if hasattr(v, "__len__") and not isinstance(v, str) and len(v) != len(self.tokens) - 1:
                raise SampleError(f"{name} has {len(v)} rows, expected one per token but the last "
                                  f"({len(self.tokens) - 1})")

    def strip_last_output_tokens(self, n: int, tokenizer: Any) -> None:
        """Miles's: drop the last ``n`` response tokens and everything kept per token for them (loss mask,
        log-probs, routed experts, indexer top-k, the per-token metadata lists), and re-decode ``response`` with
        ``tokenizer``. ``n`` beyond the response raises SampleError (a ValueError and, as in Miles, an
        AssertionError)."""
        if n <= 0:
            return
        if n > self.response_length:
            raise SampleError(f"cannot strip {n} tokens: only {self.response_length} output tokens available")
        rows = len(self.tokens) - 1     # routed experts: one row per token but the last
        self.tokens = self.tokens[:-n]
        self.response_length -= n
        if self.loss_mask is not None:
            self.loss_mask = self.loss_mask[:-n]
        if self.rollout_log_probs is not None:
            self.rollout_log_probs = self.rollout_log_probs[:-n]
        for key in PER_TOKEN_METADATA:
            if isinstance(self.metadata.get(key), list):
                self.metadata[key] = self.metadata[key][:-n]
        for name in ("rollout_routed_experts", "rollout_indexer_topk"):   # one row per token but the last
            v = getattr(self, name)
            if isinstance(v, str) and rows > 0:     # base64 of int32 [rows, layers, top-k] (SGLang's routed experts)
                raw = base64.b64decode(v)
                setattr(self, name, base64.b64encode(raw[:len(raw) // rows * (rows - n)]).decode("ascii"))
            elif v is not None:                     # an array a plugin set
                setattr(self, name, v[:-n])
        self.response = tokenizer.decode(self.tokens[-self.response_length:]) if self.response_length else ""


# Miles's Sample takes multimodal_inputs= / multimodal_train_inputs= in its constructor; here they are properties
# (rollout side only), so the dataclass __init__ is wrapped to take them too (given: assigned, as by a plugin).
_UNSET: Any = object()
_dataclass_init = Sample.__init__


def _sample_init(self: Sample, *args: Any, multimodal_inputs: Any = _UNSET, multimodal_train_inputs: Any = _UNSET,
                 **kwargs: Any) -> None:
    _dataclass_init(self, *args, **kwargs)
    if multimodal_inputs is not _UNSET:
        self.multimodal_inputs = multimodal_inputs
    if multimodal_train_inputs is not _UNSET:
        self.multimodal_train_inputs = multimodal_train_inputs


_signature = inspect.signature(_dataclass_init)
_sample_init.__signature__ = _signature.replace(parameters=[   # type: ignore[attr-defined]
    *_signature.parameters.values(),
    *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
      for name in ("multimodal_inputs", "multimodal_train_inputs"))])
_sample_init.__doc__ = _dataclass_init.__doc__
Sample.__init__ = _sample_init  # type: ignore[method-assign]
