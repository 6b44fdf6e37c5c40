"""Miles's plugin-facing Python API (the modules its examples import), each contract checked by plugins written here
against Miles v0.1.0's signatures; the rollouts run against the embedded engine on the tiny model.

Covered: ``miles.utils.{http_utils, misc, async_utils, lora, processing_utils, types}``, ``miles.rollout.rm_hub``
(``async_rm``, ``batched_async_rm``, ``math_utils``, ``math_dapo_utils``), ``miles.rollout.base_types``
(class-based rollout functions for training and evaluation), ``miles.rollout.filter_hub.base_types``,
``miles.rollout.data_source``, ``miles.rollout.checkpoint_eval``; ``--log-reward-category`` and a lone
``--eval-prompt-data PATH``.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest
from embedded_engines import start_engine, wait_engines
from transformers import AutoTokenizer

from miles.config import ConfigError, parse_args
from miles.fleet.client import EngineClient
from miles.rollout.data import DataSource
from miles.rollout.eval_fn import build_eval_function
from miles.rollout.rollout_fn import build_prompt_dataset, build_rollout_function
from miles.types import Sample, SampleStatus


def cfg(*extra: str, validate: bool = True):
    return parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", *extra], validate=validate)


# ----------------------------------------------------------------------------- miles.utils
class _Server:
    """A local JSON server: /ok answers its body back, /flaky fails twice with 503, /bad answers 404."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode() if not isinstance(body, bytes) else body
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.calls[self.path] = owner.calls.get(self.path, 0) + 1
                self._answer(200, {"path": self.path}) if self.path != "/text" else self._answer(200, b"plain")

            def do_POST(self) -> None:  # noqa: N802
                owner.calls[self.path] = owner.calls.get(self.path, 0) + 1
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
                if self.path == "/flaky" and owner.calls[self.path] <= 2:
                    return self._answer(503, {"error": "busy"})
                if self.path == "/bad":
                    return self._answer(404, {"error": "no such route"})
                self._answer(200, {"echo": body})

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_http_utils_post_get_and_wait_as_miles(server):
    from miles.utils.async_utils import run
    from miles.utils.http_utils import HttpError, get, post, wait_http_ok

    assert run(post(f"{server.url}/ok", {"a": 1})) == {"echo": {"a": 1}}
    assert run(post(f"{server.url}/flaky", {"b": 2}, max_retries=3)) == {"echo": {"b": 2}}  # 503 twice, then 200
    assert server.calls["/flaky"] == 3
    with pytest.raises(HttpError, match=r"^POST .*/bad answered HTTP 404"):  # a 4xx is final: one try
        run(post(f"{server.url}/bad", {}))
    assert server.calls["/bad"] == 1
    with pytest.raises(HttpError, match=r"^POST http://None:None/generate: invalid URL"):  # final too
        run(post("http://None:None/generate", {}))
    assert run(get(f"{server.url}/x")) == {"path": "/x"}
    assert run(post(f"{server.url}/text", None, action="get")) == "plain"  # not JSON: the text
    run(wait_http_ok(f"{server.url}/health", timeout=5))
    with pytest.raises(TimeoutError, match="not ready after 0.2s"):
        run(wait_http_ok("http://127.0.0.1:9/health", timeout=0.2, request_timeout=0.5))


def test_misc_load_function_registry_and_ports():
    import os.path

    from miles.utils.http_utils import is_port_available
    from miles.utils.misc import filter_keys, function_registry, get_free_port, load_function

    assert load_function("os.path.join") is os.path.join and load_function(None) is None
    with function_registry.temporary("os.path.join", len):  # the registry wins while registered
        assert load_function("os.path.join") is len
    assert load_function("os.path.join") is os.path.join
    with pytest.raises(ConfigError, match=r"^load_function 'no_such_mod.fn': cannot import module 'no_such_mod'"):
        load_function("no_such_mod.fn")

    async def coro() -> None: ...

    with function_registry.temporary("t:coro", coro), pytest.raises(ValueError, match="a synchronous one is required"):
        load_function("t:coro", sync_required=True)
    port = get_free_port(20000, consecutive=2)
    assert is_port_available(port) and is_port_available(port + 1)
    assert filter_keys({"a": 1, "b": 2, "c": 3}, ["c", "a"]) == {"c": 3, "a": 1}
    with pytest.raises(KeyError):
        filter_keys({"a": 1}, ["b"])


def test_async_utils_run_and_gather_helpers():
    from miles.utils.async_utils import AsyncioGatherUtils, eager_create_task, run, run_sync

    async def started_first() -> list[str]:
        order: list[str] = []

        async def first() -> None:
            order.append("first")
            await asyncio.sleep(0)

        task = await eager_create_task(first())
        order.append("caller")
        await task
        return order

    assert run(started_first()) == ["first", "caller"]
    with pytest.raises(TimeoutError):
        run_sync(asyncio.sleep(5), timeout=0.1)
    assert AsyncioGatherUtils.has_error([1, ValueError("x")]) and not AsyncioGatherUtils.has_error([1, None])


def test_lora_and_processing_utils(tiny_model_dir, tmp_path):
    from PIL import Image

    from miles.utils.images import load_image
    from miles.utils.lora import LORA_ADAPTER_NAME, is_lora_enabled
    from miles.utils.processing_utils import encode_image_for_rollout_engine, load_processor, load_tokenizer

    assert LORA_ADAPTER_NAME == "miles_lora"
    assert is_lora_enabled(cfg("--lora-rank", "4", validate=False).train)
    assert not is_lora_enabled(SimpleNamespace(lora_rank=0))
    tok = load_tokenizer(str(tiny_model_dir))
    assert tok is load_tokenizer(str(tiny_model_dir))  # cached per arguments
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert load_tokenizer(str(tiny_model_dir), chat_template_path=str(template)).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"
    with pytest.raises(FileNotFoundError, match="chat_template_path .* is not a file"):
        load_tokenizer(str(tiny_model_dir), chat_template_path=str(tmp_path / "none.jinja"))
    assert load_processor(str(tiny_model_dir)) is None  # a text-only model
    uri = encode_image_for_rollout_engine(Image.new("L", (3, 2), 200))
    assert uri.startswith("data:image/png;base64,") and load_image(uri).getpixel((0, 0)) == (200, 200, 200)


# ----------------------------------------------------------------------------- rm_hub
def test_async_rm_and_batched_async_rm_as_miles(tmp_path, monkeypatch):
    from miles.rollout.rm_hub import async_rm, batched_async_rm, grade_answer_verl
    from miles.rollout.rm_hub.math_dapo_utils import compute_score
    from miles.utils.async_utils import run

    args = SimpleNamespace(rm_type="math", custom_rm_path=None, rm_url=None, rm_timeout=5.0)
    right, wrong = Sample(response=r"so \boxed{4}", label="4"), Sample(response=r"\boxed{5}", label="4")
    assert run(async_rm(args, right)) == 1 and run(async_rm(args, wrong)) == 0
    assert run(async_rm(args, Sample(response="Answer: 7", label="7", metadata={"rm_type": "dapo"}))) == {
        "score": 1.0, "acc": True, "pred": "7"} == compute_score("Answer: 7", "7")
    assert grade_answer_verl(r"\boxed{\frac{1}{2}}", "0.5")
    with pytest.raises(NotImplementedError, match="Rule-based RM for nope is not implemented"):
        run(async_rm(SimpleNamespace(rm_type="nope", custom_rm_path=None), right))
    samples = [Sample(response=r"\boxed{4}", label="4"), Sample(response=r"\boxed{1}", label="4")]
    assert run(batched_async_rm(args, samples)) == [1, 0]
    assert run(batched_async_rm(args, samples, inplace_set_reward_field=True)) is None
    assert [s.reward for s in samples] == [1, 0]
    with pytest.raises(AssertionError, match="Overriding sample.reward"):
        run(batched_async_rm(args, samples, inplace_set_reward_field=True))
    (tmp_path / "rm_plugin_group.py").write_text(textwrap.dedent('''
        async def group(args, samples, **kwargs):
            return [len(s.response) + kwargs.get("bonus", 0) for s in samples]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = SimpleNamespace(rm_type=None, custom_rm_path="rm_plugin_group.group")
    assert run(batched_async_rm(custom, [Sample(response="abc")], bonus=1)) == [4]


def test_remote_rm_posts_prompt_response_label(server):
    from miles.rollout.rm_hub import async_rm
    from miles.utils.async_utils import run

    args = SimpleNamespace(rm_type="remote_rm", custom_rm_path=None, rm_url=f"{server.url}/rm", rm_timeout=5.0,
                           rm_max_retries=1)
    out = run(async_rm(args, Sample(prompt="p", response="r", label="l")))
    assert out == {"echo": {"prompt": "p", "response": "r", "label": "l"}}


# ----------------------------------------------------------------------------- filters, data source, metrics
def test_filter_hub_call_dynamic_filter_and_metric_gatherer():
    from miles.rollout.filter_hub.base_types import DynamicFilterOutput, MetricGatherer, call_dynamic_filter

    assert call_dynamic_filter(None, "args", []).keep
    assert call_dynamic_filter(lambda a, s: False, "args", []) == DynamicFilterOutput(keep=False)
    assert call_dynamic_filter(lambda a, s, **kw: DynamicFilterOutput(False, kw["why"]), 1, 2, why="x").reason == "x"
    g = MetricGatherer()
    for reason in ("zero_std", "zero_std", None):
        g.on_dynamic_filter_drop(reason)
    assert g.collect() == {"rollout/dynamic_filter/drop_zero_std": 2, "rollout/dynamic_filter/drop_filtered": 1}


def test_log_reward_category_metrics():
    from miles.rollout.rewards import reward_category_metrics

    samples = [Sample(reward=0.0, metadata={"rewards": {"score": 0.0, "why": "format"}}),
               Sample(reward={"score": 1.0, "why": "ok"}), Sample(reward=None, status=SampleStatus.FAILED),
               Sample(reward=0.0, metadata={"rewards": {"score": 0.0, "why": "format"}})]
    assert reward_category_metrics(samples, "why") == {"error_cat/format": 0.5, "error_cat/ok": 0.25,
                                                       "error_cat/none": 0.25}
    assert reward_category_metrics(samples, None) == {}
    assert cfg("--log-reward-category", "why").reward.log_reward_category == "why"


def test_log_passrate_is_miles_unbiased_pass_at_k(caplog):
    """--log-passrate: pass@k for k = 1, 2, 4 <= n of groups of n rewards, 1 - C(n - c, k) / C(n, k) averaged (c: the
    rewards equal to 1: True counts, 0.5, None and a dict do not); a group of another size is left out with a
    warning; {} for n = 1."""
    import math

    from miles.rollout.rewards import pass_at_k

    groups = [[1, 0, 0, 0, 1], [0.0, 0.5, None, {"r": 1}, True], [1.0] * 5, [0] * 5, [1, 1]]
    got = pass_at_k(groups, 5)
    c = [2, 1, 5, 0]
    assert sorted(got) == ["pass@1", "pass@2", "pass@4"]
    for k in (1, 2, 4):
        assert got[f"pass@{k}"] == pytest.approx(sum(1 - math.comb(5 - x, k) / math.comb(5, k) for x in c) / 4)
    assert got["pass@1"] == pytest.approx(8 / 20)                        # pass@1: the share of passing samples
    assert "excluding 1/5 incomplete groups" in caplog.text
    assert pass_at_k([[1], [0]], 1) == {} and pass_at_k([[1]], 2) == {}
    # an eval function's data (--eval-function-path): a failed sample's None counts 0, consecutive groups of n
    from miles.rollout.eval_fn import miles_eval_metrics

    m = miles_eval_metrics({"x": {"rewards": [1, 0, None, 1, 0, 0]}}, passrate_group_size=2)
    assert (m["eval/x-pass@1"], m["eval/x-pass@2"]) == (pytest.approx(2 / 6), pytest.approx(2 / 3))
    assert not any("pass@" in k for k in miles_eval_metrics({"x": {"rewards": [1, 0]}}))
    assert cfg("--log-passrate").reward.log_passrate and not cfg().reward.log_passrate


def test_a_lone_eval_prompt_data_path_is_the_aime_dataset(tmp_path, caplog):
    from miles.config.eval_datasets import resolve_eval_datasets
    from miles.utils import logging as miles_logging

    data = tmp_path / "aime.jsonl"
    data.write_text(json.dumps({"input": "1+1=", "label": "2"}) + "\n")
    miles_logging._warned.clear()
    c = cfg("--eval-prompt-data", str(data))
    (spec,) = resolve_eval_datasets(c.eval, c.data, c.rollout)
    assert (spec.name, spec.path) == ("aime", str(data))
    with pytest.raises(ConfigError, match="NAME PATH pairs"):
        cfg("--eval-prompt-data", "a", str(data), "b")


def test_checkpoint_eval_is_importable_and_refused_as_an_eval_function(tmp_path):
    from miles.rollout.checkpoint_eval import CheckpointEvalFn, retarget_args
    from miles.rollout.plugins import PluginArgs

    c = cfg()
    args = PluginArgs(c.rollout, c.cluster)
    moved = retarget_args(args, "10.0.0.2", 31000, 2, 1)
    assert (moved.sglang_router_ip, moved.sglang_router_port, moved.rollout_num_gpus) == ("10.0.0.2", 31000, 2)
    assert args.sglang_router_ip is None  # the original view is unchanged
    assert retarget_args(SimpleNamespace(a=1), "h", 1, 1, 1).sglang_router_ip == "h"
    assert issubclass(CheckpointEvalFn, object)


def test_a_plugin_needing_a_package_the_user_installs_is_one_line(tmp_path, monkeypatch):
    from miles.rollout.plugins import load_function

    for package in ("tau_bench", "camel", "omegaconf_not_installed_here", "evaluation_lib", "strands", "kimina_client"):
        (tmp_path / f"uses_{package}.py").write_text(f"import {package}\n\nasync def generate(args, sample, p): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for package in ("tau_bench", "camel", "omegaconf_not_installed_here", "evaluation_lib", "strands", "kimina_client"):
        with pytest.raises(ConfigError) as e:
            load_function(f"uses_{package}.generate", "--custom-generate-function-path")
        assert "\n" not in str(e.value) and f"No module named '{package}'" in str(e.value)


# ----------------------------------------------------------------------------- against the embedded engine
PLUGINS = '''
"""Plugins written against Miles v0.1.0's API (its names and signatures), for the tests of test_miles_plugin_api."""
from miles.rollout.base_types import (RolloutFnConstructorInput, RolloutFnEvalInput, RolloutFnEvalOutput,
                                      RolloutFnTrainInput, RolloutFnTrainOutput)
from miles.rollout.data_source import DataSource
from miles.rollout.filter_hub.base_types import MetricGatherer, call_dynamic_filter
from miles.rollout.rm_hub import batched_async_rm
from miles.utils.async_utils import run
from miles.utils.http_utils import post
from miles.utils.types import Sample


async def generate_one(args, sample: Sample) -> Sample:
    """A search-r1-style turn: POST SGLang's /generate to the router named by args (Miles's way)."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    out = await post(url, {"input_ids": list(sample.tokens), "return_logprob": True,
                           "sampling_params": {"max_new_tokens": args.rollout_max_response_len, "temperature": 1.0}})
    ids = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
    sample.tokens = list(sample.tokens) + ids
    sample.response_length = len(ids)
    sample.rollout_log_probs = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    sample.response = out["text"]
    sample.status = Sample.Status.TRUNCATED if out["meta_info"]["finish_reason"]["type"] == "length" else \\
        Sample.Status.COMPLETED
    return sample


async def _rollout(args, groups):
    import asyncio
    await asyncio.gather(*(generate_one(args, s) for g in groups for s in g))
    await batched_async_rm(args, [s for g in groups for s in g], inplace_set_reward_field=True)
    return groups


class ClassRollout:
    """Miles's RolloutFnProtocol: constructed once, called per rollout (sync __call__, Miles's async_utils.run)."""

    def __init__(self, input: RolloutFnConstructorInput):
        assert isinstance(input.data_source, DataSource)
        self.args, self.data_source, self.calls = input.args, input.data_source, []

    def __call__(self, input):
        self.calls.append((type(input).__name__, input.rollout_id, input.evaluation))
        if input.evaluation:
            groups = run(_rollout(self.args, self.data_source.get_samples(1)))
            self.data_source.add_samples(groups)
            flat = [s for g in groups for s in g]
            return RolloutFnEvalOutput(data={"mine": {"rewards": [s.reward for s in flat], "samples": flat}},
                                       metrics={"eval/calls": len(self.calls)})
        gatherer, kept = MetricGatherer(), []
        for g in run(_rollout(self.args, self.data_source.get_samples(2))):
            verdict = call_dynamic_filter(lambda args, samples: len(samples) > 0, self.args, g)
            kept.append(g) if verdict.keep else gatherer.on_dynamic_filter_drop(verdict.reason)
        return RolloutFnTrainOutput(samples=kept, metrics={"calls": len(self.calls), **gatherer.collect()})


class AsyncClassRollout(ClassRollout):
    async def __call__(self, input):
        if input.evaluation:
            groups = await _rollout(self.args, self.data_source.get_samples(1))
            return RolloutFnEvalOutput(data={"mine": {"rewards": [s.reward for g in groups for s in g]}})
        return RolloutFnTrainOutput(samples=await _rollout(self.args, self.data_source.get_samples(1)))


class NoInput:
    def __init__(self):
        pass

    def __call__(self, input):
        return []
'''


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    sup, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("plugin_api") / "engine.log", None, name="api")
    try:
        asyncio.run(wait_engines([(url, sup)]))
        yield url
    finally:
        sup.stop()


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "miles_api_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(4)))
    return data


@pytest.mark.multiprocess
def test_class_based_rollout_functions_train_and_evaluate_on_the_engine(engine, plugins, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    async def go(path: str, *extra: str):
        c = cfg("--prompt-data", str(plugins), "--rollout-function-path", path, "--n-samples-per-prompt", "2",
                "--rm-type", "math", "--label-key", "label", "--rollout-max-response-len", "3", "--log-reward-category",
                "why", *extra)
        ds = DataSource(build_prompt_dataset(c.data, tok, 0))
        async with EngineClient(engine, timeout=60, max_retries=1, concurrency=8) as client:
            fn = build_rollout_function(c, ds, tok, client)
            first = await fn.next_rollout(0)
            second = await fn.next_rollout(1)
            ev = build_eval_function(c, ds, tok, client=client)
            return fn, first, second, ev, (await ev.evaluate(2) if ev is not None else None)

    fn, (groups, metrics), (groups2, _), ev_fn, ev = asyncio.run(go("miles_api_plugins.ClassRollout"))
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    for s in (s for g in groups + groups2 for s in g):
        assert 0 < s.response_length <= 3 and len(s.rollout_log_probs) == s.response_length
        assert s.reward in (0, 1) and s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
    assert metrics["calls"] == 1.0 and metrics["error_cat/none"] == 1.0  # math's reward is no dict
    assert [g[0].prompt for g in groups2] == ["2+2=", "3+3="]  # the data source goes on across rollouts
    # constructed once per role, as Miles loads the rollout and the eval function (by default the same class)
    assert fn.instance.calls == [("RolloutFnTrainInput", 0, False), ("RolloutFnTrainInput", 1, False)]
    assert ev_fn.instance.calls == [("RolloutFnEvalInput", 2, True)]
    assert ev["eval/calls"] == 1.0 and 0.0 <= ev["eval/mine"] <= 1.0 and ev["eval/mine/response_len/max"] <= 3

    _, (groups, _), _, _, ev = asyncio.run(go("miles_api_plugins.AsyncClassRollout"))
    assert len(groups) == 1 and all(s.response_length > 0 for s in groups[0]) and "eval/mine" in ev


@pytest.mark.multiprocess
def test_the_multi_agent_stand_in_returns_every_agents_sample(engine, tiny_model_dir, monkeypatch):
    """Miles's multi-agent generate function (its stand-in, tests/fixtures/miles_scripts/plugins/.../multi_agent/) on
    the engine through the router address args: one prompt slot gives several samples, here the 5 solvers' (a tiny
    random model writes no '</think>' answer in 4 tokens, so the system stops after the solvers, as Miles's does), each
    a copy of the slot's sample with its own prompt and response ids, scored by the run's reward and weighted by
    incorrect_reward_weight; the plugin args are left unchanged."""
    from miles_fixtures import PLUGINS

    from miles.rollout.plugins import PluginArgs, router_address
    from miles.utils.http_utils import init_http_client

    monkeypatch.syspath_prepend(str(PLUGINS))
    from examples.experimental.multi_agent.rollout_with_multi_agents import (
        MULTI_AGENT_CONFIGS,
        generate_with_multi_agents,
    )

    c = cfg("--hf-checkpoint", str(tiny_model_dir), "--rm-type", "math", "--rollout-max-context-len", "64",
            validate=False)
    args = PluginArgs(c.data, c.rollout, c.reward, c.eval, c.algo, c.train, overrides=router_address(engine))
    init_http_client(args)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok("1+1=", add_special_tokens=False)["input_ids"]
    sample = Sample(group_index=3, index=7, prompt="1+1=", tokens=list(ids), label="2")
    out = asyncio.run(generate_with_multi_agents(args, sample, {"max_new_tokens": 4, "temperature": 1.0}))
    assert len(out) == MULTI_AGENT_CONFIGS["num_parallel"]
    for s in out:
        assert (s.group_index, s.index, s.label, s.prompt) == (3, 7, "2", "1+1=") and s is not sample
        assert 0 < s.response_length <= 4 and s.tokens[:len(ids)] == ids and len(s.tokens) == len(ids) + s.response_length
        assert len(s.rollout_log_probs) == s.response_length and s.status in (SampleStatus.COMPLETED,
                                                                              SampleStatus.TRUNCATED)
        assert s.reward in (0.0, MULTI_AGENT_CONFIGS["incorrect_reward_weight"])   # math's 0 or 1, x 0.8
    with pytest.raises(AttributeError):
        args.num_parallel   # noqa: B018 - set on a view, not on the run's args


def test_class_based_rollout_function_contract_errors(plugins):
    from miles.run.preflight import check_plugin

    with pytest.raises(ConfigError, match=r"'miles_api_plugins.NoInput': __init__\(self\) does not take one input"):
        check_plugin("rollout_function_path", "miles_api_plugins.NoInput")
    check_plugin("rollout_function_path", "miles_api_plugins.ClassRollout")
    check_plugin("eval_function_path", "miles_api_plugins.ClassRollout")
    (plugins.parent / "sub_builtin.py").write_text(
        "from miles.rollout.inference_rollout.inference_rollout_common import InferenceRolloutFn\n"
        "class RolloutFn(InferenceRolloutFn):\n    pass\n")
    with pytest.raises(ConfigError, match=r"^--rollout-function-path 'sub_builtin.RolloutFn': RolloutFn subclasses "
                                          r"InferenceRolloutFn, the built-in rollout"):
        check_plugin("rollout_function_path", "sub_builtin.RolloutFn")
