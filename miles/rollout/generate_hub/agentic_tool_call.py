"""Miles's agentic generate function (an agent behind Miles's session server): not available here.

It needs ``--use-session-server`` (Miles's OpenAI-compatible session server that records every model
call of ``--custom-agent-function-path``) and SGLang's OpenAI protocol, which this project does not
have; naming it fails at start-up with one line.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.plugins import unsupported


@unsupported("Miles's agentic generate needs its session server (--use-session-server, --custom-agent-function-path), "
             "which is not available; write the agent loop as an async generate(args, sample, sampling_params) with "
             "miles.rollout.generate.MultiTurn.")
async def generate(input: Any) -> Any:
    raise NotImplementedError("refused at start-up by load_function")
