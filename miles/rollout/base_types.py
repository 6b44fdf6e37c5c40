"""Miles's plugin types (``miles.rollout.base_types``): the class-based generate and rollout contracts.

    async def generate(input: GenerateFnInput) -> GenerateFnOutput    # --custom-generate-function-path

``input.args`` are the flags (a :class:`~miles.rollout.plugins.PluginArgs`, with ``args.client`` and
``args.tokenizer``), ``input.state.tokenizer`` the tokenizer, ``input.sample`` the sample to fill and
``input.sampling_params`` its sampling parameters. The output's ``samples`` is one Sample or a list of
several (Miles's multi-sample output: they all join the prompt's group, see :mod:`miles.rollout.manager`). The older
form ``generate(args, sample, sampling_params) -> Sample | list[Sample]`` works as well.

Class-based rollout functions (Miles's ``RolloutFnProtocol``) for ``--rollout-function-path`` /
``--eval-function-path``::

    class MyRollout:
        def __init__(self, input: RolloutFnConstructorInput): ...      # input.args, input.data_source
        def __call__(self, input: RolloutFnTrainInput | RolloutFnEvalInput)  # sync or async
            -> RolloutFnTrainOutput | RolloutFnEvalOutput

The class is constructed once at start-up; ``input.evaluation`` says which kind of call it is.
``RolloutFnTrainInput.weight_version`` is the engines' weight version (None before the first update);
``RolloutFnEvalInput.generate_state`` and ``hf_dir`` are None here (no snapshot evaluation).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles.types import Sample


@dataclass
class GenerateState:
    """What Miles's generate functions read from ``input.state`` (or build as ``GenerateState(args)``): ``tokenizer``
    (the run's, ``args.tokenizer``) and ``processor``, as Miles's ``load_processor(args.hf_checkpoint)``: the
    checkpoint's multimodal processor (``miles.utils.processing_utils.checkpoint_processor``, loaded once per
    checkpoint), None for a text-only model or args naming no checkpoint."""

    args: Any
    tokenizer: Any = None
    processor: Any = None
    sampling_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokenizer is None:  # Miles's GenerateState(args) loads it; here the args carry it
            self.tokenizer = getattr(self.args, "tokenizer", None)
        if self.processor is None:
            self.processor = _processor_of(self.args, self.tokenizer)


def _processor_of(args: Any, tokenizer: Any) -> Any:
    """The processor of ``--hf-checkpoint`` (else of the directory the tokenizer came from), or None."""
    from miles.utils.processing_utils import checkpoint_processor

    path = getattr(args, "hf_checkpoint", None) or getattr(tokenizer, "name_or_path", None)
    return checkpoint_processor(str(path)) if path else None


@dataclass(frozen=True)
class RolloutFnConstructorInput:
    """What a class-based rollout function is constructed with: the flags view and Miles's data-buffer API."""

    args: Any
    data_source: Any


@dataclass(frozen=True)
class RolloutFnBaseInput:
    rollout_id: int

    @property
    def evaluation(self) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class RolloutFnTrainInput(RolloutFnBaseInput):
    weight_version: int | None = None

    @property
    def evaluation(self) -> bool:
        return False


@dataclass(frozen=True)
class RolloutFnEvalInput(RolloutFnBaseInput):
    generate_state: GenerateState | None = None
    weight_version: str | None = None
    hf_dir: str | None = None

    @property
    def evaluation(self) -> bool:
        return True


RolloutFnInput = RolloutFnTrainInput | RolloutFnEvalInput


@dataclass
class GenerateFnInput:
    state: GenerateState
    sample: Sample
    sampling_params: dict[str, Any]
    evaluation: bool = False

    @property
    def args(self) -> Any:
        return self.state.args


@dataclass
class GenerateFnOutput:
    samples: Sample | list[Sample]


@dataclass
class RolloutFnTrainOutput:
    """What a ``--rollout-function-path`` function may return (a plain list of groups works too)."""

    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """What an ``--eval-function-path`` function may return (a plain dict of eval data works too): ``data`` maps a
    dataset name to ``{"rewards": [...], "truncated": [...], "samples": [...]}``; ``metrics`` are logged as given."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


RolloutFnOutput = RolloutFnTrainOutput | RolloutFnEvalOutput


def call_rollout_fn(fn: Callable[..., Any], *args: Any, evaluation: bool, **kwargs: Any) -> Any:
    """Miles's legacy call ``fn(*args, evaluation=...)``, a plain result wrapped in the output type."""
    out = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(out, RolloutFnTrainOutput | RolloutFnEvalOutput):
        out = RolloutFnEvalOutput(data=out) if evaluation else RolloutFnTrainOutput(samples=out)
    return out


def input_form(fn: Callable[[GenerateFnInput], Awaitable[Any]]) -> Callable[..., Awaitable[Sample | list[Sample]]]:
    """``fn(input) -> GenerateFnOutput`` as the ``(args, sample, sampling_params) -> Sample | list[Sample]`` the
    manager calls."""

    async def call(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample | list[Sample]:
        state = GenerateState(args=args, tokenizer=getattr(args, "tokenizer", None), sampling_params=dict(sampling_params))
        out = await fn(GenerateFnInput(state=state, sample=sample, sampling_params=sampling_params))
        return out.samples if isinstance(out, GenerateFnOutput) else getattr(out, "samples", out)

    call.__qualname__ = getattr(fn, "__qualname__", "generate")
    return call
