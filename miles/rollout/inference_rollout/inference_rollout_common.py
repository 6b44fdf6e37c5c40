"""Miles's default rollout function path, ``...inference_rollout_common.InferenceRolloutFn``.

``--rollout-function-path miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn``
(Miles v0.1.0's default) selects this project's built-in rollout,
:class:`~miles.rollout.manager.RolloutManager`: prompts -> ``/generate`` fan-out -> rewards -> dynamic
sampling. The class is the name Miles uses; the manager does the work. A subclass of it (Miles's
swe-agent example extends ``_call_train``) is refused at start-up: the built-in rollout is not a class here.
``GenerateState`` is Miles's generation state (:class:`miles.rollout.base_types.GenerateState`).
"""

from __future__ import annotations

from typing import Any

from miles.rollout.base_types import GenerateState
from miles.rollout.rollout_fn import RolloutFunctionError

__all__ = ["GenerateState", "InferenceRolloutFn", "subclass_refusal"]


def subclass_refusal(cls: type) -> str:
    return (f"{cls.__qualname__} subclasses InferenceRolloutFn, the built-in rollout, which is not a class here; write "
            "a class-based rollout function (__init__(input), __call__(input)) or a generate_rollout function.")


class InferenceRolloutFn:
    """The built-in rollout, by Miles's name (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if type(self) is not InferenceRolloutFn:
            raise RolloutFunctionError(subclass_refusal(type(self)))
        raise RolloutFunctionError("InferenceRolloutFn names the built-in rollout (the default of "
                                   "--rollout-function-path); it is not constructed.")
