"""Miles's default rollout function path, ``...inference_rollout_common.InferenceRolloutFn``.

``--rollout-function-path miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn``
(Miles v0.1.0's default) selects this project's built-in rollout,
:class:`~miles.rollout.manager.RolloutManager`: prompts -> ``/generate`` fan-out -> rewards -> dynamic
sampling. The class is the name Miles uses; the manager does the work.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.rollout_fn import RolloutFunctionError


class InferenceRolloutFn:
    """The built-in rollout, by Miles's name (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RolloutFunctionError("InferenceRolloutFn names the built-in rollout (the default of "
                                   "--rollout-function-path); it is not constructed.")
