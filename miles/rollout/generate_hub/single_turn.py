"""Miles's single-turn generation in the class-based form: one ``/generate`` on the prompt ids.

    --custom-generate-function-path miles.rollout.generate_hub.single_turn.generate

The same as leaving the flag unset (:func:`miles.rollout.sglang_rollout.generate`, the default's call): token in,
token out, log-probs and loss mask filled, status from the finish reason; under ``--use-rollout-routing-replay`` it
asks for and keeps the routed experts, under top-k OPD the student's top-k log-probs.
"""

from __future__ import annotations

from miles.rollout import sglang_rollout
from miles.rollout.base_types import GenerateFnInput, GenerateFnOutput


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    sample = await sglang_rollout.generate(input.args, input.sample, dict(input.sampling_params))
    return GenerateFnOutput(samples=sample)
