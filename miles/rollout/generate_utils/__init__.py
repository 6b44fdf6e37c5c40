"""Miles's ``miles.rollout.generate_utils`` package: the helpers its plugins import (``prefill_logprobs``,
``tool_call_utils``)."""
