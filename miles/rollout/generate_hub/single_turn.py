"""Miles's single-turn generation in the class-based form: one ``/generate`` on the prompt ids.

    --custom-generate-function-path miles.rollout.generate_hub.single_turn.generate

The same as leaving the flag unset (:func:`miles.rollout.generate.generate`): token in, token out,
log-probs and loss mask filled, status from the finish reason.
"""

from __future__ import annotations

from miles.rollout import generate as gen
from miles.rollout.base_types import GenerateFnInput, GenerateFnOutput


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    sample = await gen.generate(input.args.client, input.sample, dict(input.sampling_params))
    return GenerateFnOutput(samples=sample)
