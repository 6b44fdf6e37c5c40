"""Miles's multi-turn tool-calling generate function: not available here (refused at start-up).

It parses tool calls with SGLang's function-call parser (``--generate-tool-call-parser``) and runs the
functions of ``--generate-tool-specs-path`` / ``--generate-execute-tool-function-path``; none of these
exist in this project. Write the loop with :class:`miles.rollout.generate.MultiTurn` (see
``miles.rollout.generate.generate_with_calculator``) and pass it as ``--custom-generate-function-path``.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.plugins import unsupported


@unsupported("Miles's multi-turn tool-calling generate (SGLang's tool-call parser, --generate-tool-specs-path, "
             "--generate-execute-tool-function-path) is not available; write the loop with "
             "miles.rollout.generate.MultiTurn (example: miles.rollout.generate.generate_with_calculator).")
async def generate(input: Any) -> Any:
    raise NotImplementedError("refused at start-up by load_function")
