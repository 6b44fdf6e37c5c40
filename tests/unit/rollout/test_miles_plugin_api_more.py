"""Miles's plugin API, the modules its examples import beyond the first round: ``mask_utils``, ``eval_config``,
``dumper_utils``, ``generate_utils.prefill_logprobs`` (against the embedded engine), ``RolloutDataSourceWithBuffer``
and ``inference_rollout_eval.run_eval_datasets`` (from a class-based eval function), each used as Miles's plugins
use them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from embedded_engines import start_engine, wait_engines
from transformers import AutoTokenizer

from miles.config import parse_args
from miles.rollout.eval_fn import build_eval_function
from miles.types import Sample, SampleStatus


def cfg(*extra: str):
    return parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", *extra])


def test_mask_utils_trains_the_assistant_turns(tiny_model_dir):
    from miles.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    gen = MultiTurnLossMaskGenerator(tok, tokenizer_type="qwen3")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "tool", "content": "T"},
            {"role": "assistant", "content": "A2", "step_loss_mask": 0}, {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A3"}]
    ids, mask = gen.get_loss_mask(msgs)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert gen.get_text_from_loss_mask(ids, mask) == ["A1<|im_end|>\n", "A3<|im_end|>\n"]
    assert get_response_lengths([mask, [0, 0]]) == [len(mask) - mask.index(1), 0]
    d_ids, d_mask = MultiTurnLossMaskGenerator(tok, "distill_qwen").get_loss_mask(msgs[1:3])
    assert tok.decode([t for t, m in zip(d_ids, d_mask) if m]) == "A1" and d_mask[0] == 0
    ids2, mask2 = gen.get_loss_mask_with_multimodal_alignment(msgs, [7, 7] + ids)
    assert ids2[:2] == [7, 7] and mask2 == [0, 0] + mask
    with pytest.raises(ValueError, match="tokenizer_type 'llama' is not supported"):
        MultiTurnLossMaskGenerator(tok, "llama")


def test_eval_config_resolves_as_miles_and_dumper_is_off():
    from miles.utils import dumper_utils
    from miles.utils.eval_config import (
        DATASET_RUNTIME_SPECS,
        _apply_dataset_field_overrides,
        build_eval_dataset_configs,
        ensure_dataset_list,
    )

    args = SimpleNamespace(eval_temperature=None, rollout_temperature=0.7, eval_top_p=0.9, rollout_top_p=1.0,
                           n_samples_per_eval_prompt=None, n_samples_per_prompt=4, eval_top_k=None, rollout_top_k=-1,
                           eval_max_response_len=None, rollout_max_response_len=64, eval_input_key=None,
                           input_key="q", eval_label_key=None, label_key="a", eval_tool_key=None, tool_key=None,
                           metadata_key="metadata")
    ds = {"name": "x", "top_p": 0.5}
    _apply_dataset_field_overrides(args, ds, {"max_response_len": 32}, DATASET_RUNTIME_SPECS)
    assert ds == {"name": "x", "top_p": 0.5, "temperature": 0.7, "n_samples_per_eval_prompt": 4, "top_k": -1,
                  "max_response_len": 32}
    [spec] = build_eval_dataset_configs(args, ensure_dataset_list({"x": {"path": "/d.jsonl"}}), {})
    assert (spec.name, spec.path, spec.input_key, spec.label_key, spec.temperature, spec.top_p) == (
        "x", "/d.jsonl", "q", "a", 0.7, 0.9)
    off = SimpleNamespace(dumper_enable=False, dumper_inference=None)
    assert asyncio.run(dumper_utils.configure_sglang(off)) is None and dumper_utils.get_sglang_env(off) == {}
    with pytest.raises(ValueError, match="^the tensor dumper .* is not provided by miles"):
        asyncio.run(dumper_utils.configure_sglang(SimpleNamespace(dumper_enable=True, dumper_inference=None)))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    sup, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("plugin_api_more") / "engine.log", None,
                            name="api2")
    try:
        asyncio.run(wait_engines([(url, sup)]))
        yield url
    finally:
        sup.stop()


@pytest.mark.multiprocess
def test_prefill_logprobs_rescores_responses_on_the_engine(engine, tiny_model_dir):
    """Miles's recompute_samples_rollout_logprobs_via_prefill: off unless args ask; on, each response's log-probs
    are the engine's prefill scores of exactly its tokens (as a teacher's), and an aborted sample is left alone."""
    from miles.rollout.generate_utils.prefill_logprobs import recompute_samples_rollout_logprobs_via_prefill
    from miles.utils.http_utils import post

    url = f"{engine}/generate"

    async def go():
        out = await post(url, {"input_ids": [5, 6, 7, 8], "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        ids = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
        decode_lps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        s = Sample(tokens=[5, 6, 7, 8] + ids, response_length=len(ids), rollout_log_probs=[0.0] * len(ids),
                   status=SampleStatus.COMPLETED)
        aborted = Sample(tokens=[5, 6, 7], response_length=1, rollout_log_probs=[0.0], status=SampleStatus.ABORTED)
        await recompute_samples_rollout_logprobs_via_prefill(SimpleNamespace(), [s], url=url, sampling_params={})
        assert s.rollout_log_probs == [0.0] * len(ids)                        # the flag is off: nothing
        on = SimpleNamespace(recompute_logprobs_via_prefill=True)
        await recompute_samples_rollout_logprobs_via_prefill(on, [s, aborted], url=url, sampling_params={"top_p": 1})
        return s, aborted, decode_lps

    s, aborted, decode_lps = asyncio.run(go())
    assert s.metadata["rollout_log_probs_source"] == "sglang_prefill_recompute" and aborted.rollout_log_probs == [0.0]
    # the embedded engine: prefill = decode, measured 2.4e-7 apart (CPU, 2026-12-07)
    assert s.rollout_log_probs == pytest.approx(decode_lps, abs=5e-7)


PLUGIN = '''
from miles.rollout.base_types import GenerateState, RolloutFnEvalOutput
from miles.rollout.data_source import RolloutDataSourceWithBuffer
from miles.rollout.inference_rollout.inference_rollout_eval import run_eval_datasets


class EvalWithBuiltin:
    """A class-based eval function adding to the run's built-in evaluation (as Miles's external_eval_fn does)."""

    def __init__(self, input):
        self.args = input.args
        self.own = RolloutDataSourceWithBuffer(input.args)

    async def __call__(self, input):
        data = await run_eval_datasets(GenerateState(self.args), {})
        groups = self.own.get_samples(1)
        self.own.add_samples(groups)
        return RolloutFnEvalOutput(data=data, metrics={"eval/own_prompt_len": float(len(groups[0][0].tokens)),
                                                       "eval/own_buffer": float(self.own.get_buffer_length())})
'''


def test_run_eval_datasets_and_data_source_with_buffer(tmp_path, monkeypatch, tiny_model_dir):
    """run_eval_datasets inside a class-based eval call gives the run's built-in evaluation of that rollout
    (here the driver's built-in evaluation is a recorded function: the plumbing is what is tested);
    RolloutDataSourceWithBuffer reads --prompt-data as the run does; outside an evaluation it is one line."""
    from miles.rollout.base_types import GenerateState
    from miles.rollout.data import DataSource
    from miles.rollout.inference_rollout.inference_rollout_eval import run_eval_datasets
    from miles.rollout.rollout_fn import RolloutFunctionError, build_prompt_dataset

    (tmp_path / "eval_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(3)))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    c = cfg("--prompt-data", str(rows), "--eval-function-path", "eval_plugin.EvalWithBuiltin", "--rm-type", "math",
            "--n-samples-per-prompt", "2")
    calls = []

    async def builtin(rollout_id):
        calls.append(rollout_id)
        s = Sample(response_length=1, reward=1.0, status=SampleStatus.COMPLETED)
        return {"d": {"rewards": [1.0], "truncated": [False], "samples": [s]}}, {}

    ev = build_eval_function(c, DataSource(build_prompt_dataset(c.data, tok, 0)), tok, builtin=builtin)
    metrics = asyncio.run(ev.evaluate(5))
    assert calls == [5] and metrics["eval/d"] == 1.0
    assert metrics["eval/own_prompt_len"] == len(tok("0+0=")["input_ids"]) and metrics["eval/own_buffer"] == 1.0
    with pytest.raises(RolloutFunctionError, match="^run_eval_datasets runs the run's built-in evaluation"):
        asyncio.run(run_eval_datasets(GenerateState(SimpleNamespace()), {}))
