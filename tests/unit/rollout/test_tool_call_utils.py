"""Miles's ``miles.rollout.generate_utils.tool_call_utils`` with Miles's names and signatures: tool calls of both
forms executed in order, tool responses templated as the chat template appends them (a Qwen-style template), a
template that is not append-only refused in one line, a sample extended with loss mask 0, and SGLang's parser named
by its extra when SGLang is missing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from miles.rollout.generate_utils.tool_call_utils import (
    _DUMMY_USER,
    ToolCallError,
    _build_dummy_assistant,
    create_tool_call_parser,
    execute_tool_calls,
    tokenize_tool_responses,
    update_sample_with_tool_responses,
)
from miles.types import Sample
from miles.utils.optional import MissingDependencyError, available

# Qwen's way of rendering tool turns: consecutive tool messages in one user turn, each in <tool_response>
QWEN_STYLE = r"""
{%- for m in messages -%}
{%- if m['role'] == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}
{{ '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}
{%- elif m['role'] == 'assistant' -%}
{{ '<|im_start|>assistant\n' + m['content'] }}
{%- for c in m.get('tool_calls') or [] -%}{{ '<tool_call>\n{"name": "' + c['function']['name'] + '"}\n</tool_call>' }}{%- endfor -%}
{{ '<|im_end|>\n' }}
{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}
"""
# a thinking model's way: the reasoning of the last assistant turn only (earlier turns change when one is added)
THINKING = QWEN_STYLE.replace("{{ '<|im_start|>assistant\\n' + m['content'] }}",
                              "{{ '<|im_start|>assistant\\n' }}{%- if loop.last -%}{{ '<think>' + m['reasoning_content'] "
                              "+ '</think>' }}{%- endif -%}{{ m['content'] }}")
RESPONSES = [{"role": "tool", "tool_call_id": "call00000", "content": '{"year": 2026}', "name": "get_year"},
             {"role": "tool", "tool_call_id": "call00001", "content": '{"temperature": 25}', "name": "get_temperature"}]


@pytest.fixture
def tok():
    from miles.utils.tiny_model import build_tokenizer

    t = build_tokenizer()
    t.chat_template = QWEN_STYLE
    return t


def test_tool_responses_are_what_the_template_appends(tok):
    ids = tokenize_tool_responses(RESPONSES, tok)
    assert tok.decode(ids) == ('<|im_start|>user\n<tool_response>\n{"year": 2026}\n</tool_response>\n'
                               '<tool_response>\n{"temperature": 25}\n</tool_response><|im_end|>\n'
                               '<|im_start|>assistant\n')
    # the same as Miles's test computes it: the template's text after the dummy user and assistant turns
    base = [_DUMMY_USER, _build_dummy_assistant(RESPONSES[:1])]
    without = tok.apply_chat_template(base, tokenize=False, add_generation_prompt=False)
    with_ = tok.apply_chat_template(base + RESPONSES[:1], tokenize=False, add_generation_prompt=True)
    assert tok.decode(tokenize_tool_responses(RESPONSES[:1], tok)) == with_[len(without):]
    assert [c["id"] for c in _build_dummy_assistant(RESPONSES)["tool_calls"]] == ["call00000", "call00001"]
    assert _build_dummy_assistant([{"content": "x"}])["tool_calls"][0]["function"]["name"] == "dummy_func"


def test_a_template_that_rewrites_earlier_turns_is_one_line(tok):
    tok.chat_template = THINKING
    with pytest.raises(ToolCallError, match=r"renders the tool responses of \['get_year'\] by changing the earlier "
                                            r"turns \(not append-only"):
        tokenize_tool_responses(RESPONSES[:1], tok)


def test_update_sample_appends_untrained_ids(tok):
    prompt = tok("Q?", add_special_tokens=False)["input_ids"]
    s = Sample(tokens=prompt + [40, 41], response_length=2, response="ab", loss_mask=[1, 1],
               rollout_log_probs=[-0.5, -0.25])
    update_sample_with_tool_responses(s, RESPONSES[:1], tok)
    added = tokenize_tool_responses(RESPONSES[:1], tok)
    assert s.tokens == prompt + [40, 41] + added and s.response_length == 2 + len(added)
    assert s.loss_mask == [1, 1] + [0] * len(added) and s.rollout_log_probs == [-0.5, -0.25] + [0.0] * len(added)
    assert s.response == "ab" + tok.decode(added)


def test_execute_tool_calls_takes_both_call_forms_in_order():
    seen = []

    async def execute_one(name, params):
        seen.append((name, params))
        return f"{name}:{sorted(params.items())}"

    openai_call = SimpleNamespace(id="c1", function=SimpleNamespace(name="search", arguments='{"q": "x"}'))
    sglang_item = SimpleNamespace(tool_index=0, name="now", parameters="")
    out = asyncio.run(execute_tool_calls([openai_call, sglang_item], execute_one))
    assert seen == [("search", {"q": "x"}), ("now", {})]
    assert out[0] == {"role": "tool", "tool_call_id": "c1", "content": "search:[('q', 'x')]", "name": "search"}
    assert out[1]["tool_call_id"].startswith("call_") and len(out[1]["tool_call_id"]) == 29 and out[1]["name"] == "now"


@pytest.mark.parametrize("call, execute_result, error, message", [
    (SimpleNamespace(x=1), "ok", TypeError, "Unsupported tool call type: SimpleNamespace"),
    (SimpleNamespace(name="f", parameters="{bad"), "ok", ToolCallError, "tool call 'f': arguments '{bad' are not JSON"),
    (SimpleNamespace(name="f", parameters="[1]"), "ok", ToolCallError, "are not a JSON object"),
    (SimpleNamespace(name="f", parameters="{}"), 3, ToolCallError, "tool 'f': execute_one returned int, expected"),
])
def test_execute_tool_calls_bad_inputs_are_one_line(call, execute_result, error, message):
    async def execute_one(name, params):
        return execute_result

    with pytest.raises(error, match=message):
        asyncio.run(execute_tool_calls([call], execute_one))


@pytest.mark.skipif(available("sglang"), reason="SGLang is installed")
def test_the_parser_without_sglang_names_the_extra():
    with pytest.raises(MissingDependencyError, match=r"create_tool_call_parser\('qwen25'\).*pip install 'miles\[sglang\]'"):
        create_tool_call_parser([], "qwen25")


@pytest.mark.sglang
def test_the_parser_is_sglangs():
    pytest.importorskip("sglang")
    spec = [{"type": "function", "function": {"name": "get_year", "parameters": {"type": "object", "properties": {}}}}]
    parser = create_tool_call_parser(spec, "qwen25")
    text, calls = parser.parse_non_stream('ok <tool_call>\n{"name": "get_year", "arguments": {}}\n</tool_call>')
    assert text.strip() == "ok" and [c.name for c in calls] == ["get_year"]
    out = asyncio.run(execute_tool_calls(calls, lambda name, params: asyncio.sleep(0, result="2026")))
    assert out[0]["content"] == "2026" and out[0]["name"] == "get_year"
