"""Miles's ``miles.rollout.generate_utils.tool_call_utils``: tool calls inside a multi-turn generate function.

    parser = create_tool_call_parser(tool_specs, "qwen25")        # SGLang's FunctionCallParser (needs sglang)
    normal_text, calls = parser.parse_non_stream(turn_text)
    tool_messages = await execute_tool_calls(calls, execute_one)   # execute_one(name, params) -> str
    update_sample_with_tool_responses(sample, tool_messages, tokenizer)

- ``create_tool_call_parser(tool_specs, tool_call_parser)``: SGLang's ``FunctionCallParser`` over the OpenAI tool
  specs, by SGLang's parser name; without SGLang one line naming the ``miles[sglang]`` extra.
- ``execute_tool_calls(tool_calls, execute_one)``: each call in order, an OpenAI ``ChatCompletionMessageToolCall``
  (``.id``, ``.function.name``, ``.function.arguments``) or SGLang's ``ToolCallItem`` (``.name``, ``.parameters``;
  a fresh ``call_<24 hex>`` id), its JSON arguments decoded and passed to ``await execute_one(name, params)``,
  which returns the tool's text; the result is one ``{"role": "tool", "tool_call_id", "content", "name"}`` message
  per call.
- ``tokenize_tool_responses(tool_messages, tokenizer)``: the ids the tokenizer's chat template adds for those tool
  messages and the next assistant prompt, after an assistant turn that made the calls (rendered with a dummy user
  message and a dummy assistant message carrying one tool call per response: ``_DUMMY_USER``,
  ``_build_dummy_assistant``). A template that renders them by rewriting the earlier turns (not append-only, e.g.
  one that drops a thinking model's reasoning) gives one line: token-in-token-out cannot extend a sample with it.
- ``update_sample_with_tool_responses(sample, tool_messages, tokenizer)``: those ids appended to the sample as
  response tokens not trained on (loss mask 0, log-prob 0.0), as ``MultiTurn.add_observation`` appends them.

Each problem is one line: an unknown call type (TypeError), arguments that are not a JSON object, or a tool that
did not return a string (ToolCallError, a ValueError).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from miles.rollout.generate import append_observation
from miles.types import Sample
from miles.utils.errors import MilesError
from miles.utils.optional import require

__all__ = ["create_tool_call_parser", "execute_tool_calls", "tokenize_tool_responses",
           "update_sample_with_tool_responses", "ToolCallError"]

_DUMMY_USER = {"role": "user", "content": "dummy"}


class ToolCallError(MilesError, ValueError):
    """A tool call or its response cannot be used; the message names the tool and what is wrong."""


def create_tool_call_parser(tool_specs: list[dict[str, Any]], tool_call_parser: str) -> Any:
    """SGLang's ``FunctionCallParser`` for ``tool_specs`` (OpenAI tool specs) and the parser named
    ``tool_call_parser`` (SGLang's names: ``qwen25``, ``qwen3_coder``, ``llama3``, ...)."""
    feature = f"create_tool_call_parser({tool_call_parser!r}) (SGLang's tool-call parser)"
    parser_mod = require("sglang.srt.function_call.function_call_parser", feature)
    protocol = require("sglang.srt.entrypoints.openai.protocol", feature)
    from pydantic import TypeAdapter

    tools = TypeAdapter(list[protocol.Tool]).validate_python(tool_specs)
    return parser_mod.FunctionCallParser(tools=tools, tool_call_parser=tool_call_parser)


def _call_parts(call: Any) -> tuple[str, str | None, str]:
    """(name, JSON arguments, id) of an OpenAI tool call or an SGLang ToolCallItem."""
    function = getattr(call, "function", None)
    if function is not None and hasattr(function, "name"):            # openai ChatCompletionMessageToolCall
        return function.name, getattr(function, "arguments", None), call.id
    if hasattr(call, "name") and hasattr(call, "parameters"):          # sglang ToolCallItem
        return call.name, call.parameters, f"call_{uuid.uuid4().hex[:24]}"
    raise TypeError(f"Unsupported tool call type: {type(call).__name__} (expected an OpenAI "
                    "ChatCompletionMessageToolCall or SGLang's ToolCallItem)")


async def execute_tool_calls(tool_calls: list[Any],
                             execute_one: Callable[[str, dict[str, Any]], Awaitable[str]]) -> list[dict[str, Any]]:
    """One tool message per call, the calls run in order (see the module docstring)."""
    messages = []
    for call in tool_calls:
        name, arguments, call_id = _call_parts(call)
        try:
            params = arguments if isinstance(arguments, dict) else json.loads(arguments) if arguments else {}
        except (TypeError, ValueError) as e:
            raise ToolCallError(f"tool call {name!r}: arguments {str(arguments)[:200]!r} are not JSON ({e})") from e
        if not isinstance(params, dict):
            raise ToolCallError(f"tool call {name!r}: arguments {str(arguments)[:200]!r} are not a JSON object")
        result = await execute_one(name, params)
        if not isinstance(result, str):
            raise ToolCallError(f"tool {name!r}: execute_one returned {type(result).__name__}, expected the tool's "
                                "output as a str")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result, "name": name})
    return messages


def _build_dummy_assistant(tool_responses: list[dict[str, Any]]) -> dict[str, Any]:
    """An assistant message that made one call per tool response (its id and name), for rendering the responses."""
    calls = [{"id": r.get("tool_call_id", f"call0000{i}"), "type": "function",
              "function": {"name": r.get("name", "dummy_func"), "arguments": {}}}
             for i, r in enumerate(tool_responses)]
    return {"role": "assistant", "content": "", "reasoning_content": " ", "tool_calls": calls}


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=False)
    if hasattr(out, "keys") and "input_ids" in out:     # a tokenizer that returns a BatchEncoding regardless
        out = out["input_ids"]
    return list(out)


def tokenize_tool_responses(tool_messages: list[dict[str, Any]], tokenizer: Any) -> list[int]:
    """The chat template's ids for ``tool_messages`` and the next assistant prompt (see the module docstring)."""
    base = [_DUMMY_USER, _build_dummy_assistant(tool_messages)]
    before = _template_ids(tokenizer, base, add_generation_prompt=False)
    after = _template_ids(tokenizer, base + list(tool_messages), add_generation_prompt=True)
    if after[:len(before)] != before:
        names = [m.get("name") for m in tool_messages]
        raise ToolCallError(
            f"tokenize_tool_responses: the chat template of {getattr(tokenizer, 'name_or_path', 'the tokenizer')!r} "
            f"renders the tool responses of {names} by changing the earlier turns (not append-only, e.g. a thinking "
            "model's template that drops reasoning), so they cannot be appended to the sample's ids; append the "
            "observation's ids yourself (MultiTurn.add_observation)")
    return after[len(before):]


def update_sample_with_tool_responses(sample: Sample, tool_messages: list[dict[str, Any]], tokenizer: Any) -> None:
    """Append the templated tool responses to ``sample`` (loss mask 0, log-prob 0.0)."""
    append_observation(sample, tokenize_tool_responses(tool_messages, tokenizer), tokenizer.decode)
