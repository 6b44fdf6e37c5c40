"""--eval-function-path: Miles's eval function contract.

Against a real embedded engine (``python -m miles.engine``) and a local HTTP server standing in for NeMo Skills:
Miles's eval_delegate_rollout (its stand-in, tests/fixtures/miles_scripts/plugins) is called with evaluation=True,
reads eval.delegate from args.eval_config, posts to the server with the router address, runs the built-in evaluation
through miles.rollout.sglang_rollout.generate_rollout, and both become eval/ metrics as Miles logs them. Without an
engine: the shape checks and Miles's metric formulas, and every failure (raises, hangs, bad shape, server down, the
built-in eval called from an async function or outliving the call) is one line naming the flag and the function,
within the bound.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from test_manager import launch_engine, stop, wait_engines

from miles.config import parse_args
from miles.rollout.eval_fn import EvalFunction, EvalFunctionError, build_eval_function
from miles.rollout.plugins import PluginArgs
from miles.utils.net import find_free_port

STAND_INS = Path(__file__).resolve().parents[2] / "fixtures" / "miles_scripts" / "plugins"
DELEGATE = "examples.experimental.eval.eval_delegate_rollout.generate_rollout"


# ----------------------------------------------------------------------------- helpers
class SkillsServer:
    """POST /evaluate: records the JSON body and answers ``reply`` (or status ``status``)."""

    def __init__(self, reply: dict[str, Any], status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.bodies.append(json.loads(body))
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/evaluate"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    proc, url = launch_engine(tiny_model_dir)
    try:
        wait_engines((proc, url))
        yield url
    finally:
        stop(proc)


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.syspath_prepend(str(STAND_INS))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "examples"]:
        sys.modules.pop(name)


def _rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(n)))
    return path


def _doc(tmp_path: Path, delegate_url: str) -> Path:
    doc = {"eval": {"defaults": {"temperature": 0.0, "max_response_len": 4},
                    "datasets": [{"name": "tiny", "path": str(_rows(tmp_path / "eval.jsonl", 3)),
                                  "rm_type": "exact_match", "n_samples_per_eval_prompt": 2}],
                    "delegate": [{"name": "skills", "url": delegate_url, "timeout_secs": 5, "max_retries": 1,
                                  "headers": {}, "datasets": [{"name": "aime25", "max_response_len": 8192,
                                                               "n_samples_per_eval_prompt": 8},
                                                              {"name": "hle"}]}]}}
    (tmp_path / "multi_tasks.yaml").write_text(json.dumps(doc))
    return tmp_path / "multi_tasks.yaml"


def _cfg(tmp_path: Path, *extra: str):
    return parse_args(["--prompt-data", str(_rows(tmp_path / "train.jsonl", 4)), "--label-key", "label",
                       "--num-rollout", "1", "--rollout-batch-size", "2", "--rollout-max-response-len", "4", "--rm-type",
                       "math", *extra])


def _run_delegate(engine: str, tok: Any, tmp_path: Path, delegate_url: str) -> tuple[dict, dict]:
    """(metrics of the eval function, metrics of the built-in evaluation) on the same datasets."""
    from miles.config.eval_datasets import resolve_eval_datasets
    from miles.fleet.client import EngineClient
    from miles.rollout.data import load_eval_datasets
    from miles.rollout.manager import RolloutManager
    from miles.run.build import plugin_extra

    cfg = _cfg(tmp_path, "--eval-config", str(_doc(tmp_path, delegate_url)), "--eval-function-path", DELEGATE)
    datasets = load_eval_datasets(resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout), cfg.eval, cfg.data, tok)

    async def main() -> tuple[dict, dict]:
        client = EngineClient(engine)
        try:
            mgr = RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, tok, None, eval_cfg=cfg.eval)
            fn = build_eval_function(cfg, None, tok, client=mgr.client, router_url=engine,
                                     builtin=lambda rid: mgr.evaluate_data(datasets, rid),
                                     extra=plugin_extra(cfg, datasets))
            assert fn is not None
            return await fn.evaluate(7), await mgr.evaluate(datasets, 7)
        finally:
            await client.close()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


# ----------------------------------------------------------------------------- real engine
@pytest.mark.multiprocess
def test_miles_eval_delegate_rollout_runs_with_the_builtin_eval_and_the_server(engine, tok, tmp_path, stand_ins):
    server = SkillsServer({"raw_metrics": {"aime25": {"accuracy": 0.25, "num": 8}, "hle": {"accuracy": 0.5},
                                           "note": "text is skipped"}})
    try:
        m, builtin = _run_delegate(engine, tok, tmp_path, server.url)
    finally:
        server.close()
    (body,) = server.bodies  # one request per evaluation, as Miles's skills client sends it
    assert body["rollout_id"] == 7 and body["router_url"] == engine  # args.sglang_router_ip/port: this run's router
    assert body["benchmarks"] == [{"name": "aime25", "n_samples_per_eval_prompt": 8, "temperature": 0.0,
                                   "max_response_len": 8192},
                                  {"name": "hle", "temperature": 0.0, "max_response_len": 4}]
    assert m["eval/aime25/accuracy"] == 0.25 and m["eval/aime25/num"] == 8 and m["eval/hle/accuracy"] == 0.5
    # the built-in evaluation of eval.datasets, logged as Miles logs eval data
    assert m["eval/tiny"] == builtin["eval/tiny"]  # temperature 0, no failures: the same rewards
    assert m["eval/tiny-none_reward_ratio"] == 0.0 == builtin["eval/tiny-none_reward_ratio"]
    assert m["eval/tiny-truncated_ratio"] == builtin["eval/tiny-truncated_ratio"] == builtin["eval/tiny/truncated_ratio"]
    assert 0 < m["eval/tiny/response_len/max"] <= 4 and m["eval/tiny/response_len/min"] >= 0
    assert not any(k.startswith("eval/note") for k in m)


@pytest.mark.multiprocess
def test_delegate_server_down_is_one_line(engine, tok, tmp_path, stand_ins):
    dead = f"http://127.0.0.1:{find_free_port()}/evaluate"
    t0 = time.monotonic()
    with pytest.raises(EvalFunctionError) as ei:
        _run_delegate(engine, tok, tmp_path, dead)
    msg = str(ei.value)
    assert msg.startswith(f"--eval-function-path {DELEGATE} failed: RuntimeError: skills evaluation request to {dead}")
    assert "\n" not in msg and time.monotonic() - t0 < 60


# ----------------------------------------------------------------------------- contract, without an engine
PLUGINS = textwrap.dedent('''
    import asyncio, time
    from miles.rollout.base_types import RolloutFnEvalOutput
    from miles.rollout.sglang_rollout import generate_rollout as base

    calls = []
    cancelled = []

    def record(args, rollout_id, data_source, evaluation=False):
        calls.append((rollout_id, evaluation, args.eval_config, type(data_source).__name__))
        return {"mine": {"rewards": [1.0, None, 0.0, 1.0], "truncated": [False, True, False, False]}}

    async def as_output(args, rollout_id, data_source, evaluation=False):
        return RolloutFnEvalOutput(data={"a": {"rewards": [1, 0]}}, metrics={"eval/extra": 3, "text": "skipped"})

    def raises(args, rollout_id, data_source, evaluation=False):
        raise RuntimeError("skills exploded\\nsecond line")

    def hangs(args, rollout_id, data_source, evaluation=False):
        time.sleep(30)

    async def hangs_async(args, rollout_id, data_source, evaluation=False):
        await asyncio.sleep(30)

    def a_list(args, rollout_id, data_source, evaluation=False):
        return [1, 2]

    def text_reward(args, rollout_id, data_source, evaluation=False):
        return {"a": {"rewards": ["0.5"]}}

    def short_truncated(args, rollout_id, data_source, evaluation=False):
        return {"a": {"rewards": [1.0, 0.0], "truncated": [True]}}

    async def builtin_from_async(args, rollout_id, data_source, evaluation=False):
        return base(args, rollout_id, data_source, evaluation=True)

    def builtin_from_sync(args, rollout_id, data_source, evaluation=False):
        return base(args, rollout_id, data_source, evaluation=True)

    def two_args(args, rollout_id):
        return {}
''')


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "evalfn_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("evalfn_plugins")
    sys.modules.pop("evalfn_plugins", None)


def _fn(name: str, timeout: float = 5.0, builtin: Any = None, data_source: Any = None,
        eval_config: str | None = None) -> EvalFunction:
    from miles.config.data import EvalConfig

    ev = EvalConfig(eval_prompt_data=None, eval_config=eval_config, eval_function_path=f"evalfn_plugins.{name}",
                    eval_interval=1, n_samples_per_eval_prompt=1, eval_max_response_len=None, eval_temperature=None,
                    eval_top_p=None, eval_top_k=None, eval_min_new_tokens=None, eval_max_prompt_len=None,
                    eval_max_context_len=None, eval_input_key=None, eval_label_key=None, eval_tool_key=None,
                    skip_eval_before_train=False)
    return EvalFunction(f"evalfn_plugins.{name}", PluginArgs(ev), data_source, 2, timeout=timeout, builtin=builtin)


def test_called_with_evaluation_true_and_logged_as_miles_logs(plugins, tmp_path):
    from miles.config.data import DataConfig  # noqa: F401 - the data source below is the rollout's
    from miles.rollout.data import DataSource

    class Rows:  # the smallest dataset a DataSource takes
        path, items = "rows", []

        def __len__(self) -> int:
            return 1

    m = asyncio.run(_fn("record", eval_config=str(tmp_path / "e.yaml"), data_source=DataSource(Rows())).evaluate(4))
    assert plugins.calls == [(4, True, str(tmp_path / "e.yaml"), "MilesDataBuffer")]
    # Miles's log_eval_rollout_data: a None reward counts 0 and is counted; -truncated_ratio from "truncated"
    assert m == {"eval/mine": 0.5, "eval/mine-none_reward_ratio": 0.25, "eval/mine-truncated_ratio": 0.25}
    m = asyncio.run(_fn("as_output").evaluate(0))
    assert m == {"eval/extra": 3.0, "eval/a": 0.5, "eval/a-none_reward_ratio": 0.0}


@pytest.mark.parametrize("name, expected", [
    ("raises", "failed: RuntimeError: skills exploded"),
    ("hangs", "did not return within --distributed-timeout-minutes (in seconds) 1s; the call was abandoned"),
    ("hangs_async", "did not return within --distributed-timeout-minutes (in seconds) 1s; the call was cancelled"),
    ("a_list", "returned list; expected a dict of dataset name -> {'rewards'"),
    ("text_reward", "returned data['a']['rewards'] holds '0.5'; each reward must be a number or None"),
    ("short_truncated", "returned data['a']['truncated'] has 1 entries for 2 rewards"),
    ("builtin_from_async", "was called from an async eval function, on the loop it needs: make the eval function a "
                           "plain def"),
])
def test_failures_are_one_line_naming_the_flag_and_function(plugins, name, expected):
    async def builtin(rid: int) -> Any:
        return {}, {}

    t0 = time.monotonic()
    with pytest.raises(EvalFunctionError) as ei:
        asyncio.run(_fn(name, timeout=1.0, builtin=builtin).evaluate(0))
    msg = str(ei.value)
    assert msg.startswith(f"--eval-function-path evalfn_plugins.{name}") and expected in msg, msg
    assert "\n" not in msg and time.monotonic() - t0 < 5


def test_builtin_eval_outliving_the_call_is_cancelled(plugins):
    """The sync eval function waits on the built-in evaluation past the bound: the call ends in one line, and the
    evaluation it started is cancelled (nothing keeps running on the loop)."""
    state: dict[str, Any] = {}

    async def slow(rid: int) -> Any:
        state["started"] = True
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        return {}, {}

    async def main() -> None:
        with pytest.raises(EvalFunctionError, match=r"^--eval-function-path evalfn_plugins.builtin_from_sync\b.* did "
                                                    r"not return within --distributed-timeout-minutes [^\n]*$"):
            await _fn("builtin_from_sync", timeout=1.0, builtin=slow).evaluate(0)
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert state == {"started": True, "cancelled": True}


def test_builtin_eval_data_reaches_the_function(plugins):
    async def builtin(rid: int) -> Any:
        from miles.types import Sample, SampleStatus

        s = [Sample(tokens=[1, 2, 3], response_length=2, reward=1.0, status=SampleStatus.TRUNCATED),
             Sample(tokens=[1, 2], response_length=1, reward=0.0)]
        return {"ds": {"rewards": [1.0, 0.0], "truncated": [True, False], "samples": s}}, {"ignored": 1.0}

    m = asyncio.run(_fn("builtin_from_sync", builtin=builtin).evaluate(2))
    assert m == {"eval/ds": 0.5, "eval/ds-none_reward_ratio": 0.0, "eval/ds-truncated_ratio": 0.5,
                 "eval/ds/response_len/mean": 1.5, "eval/ds/response_len/median": 1.5,
                 "eval/ds/response_len/max": 2.0, "eval/ds/response_len/min": 1.0, "eval/ds/truncated_ratio": 0.5}


def test_builtin_eval_outside_an_eval_function_call_is_one_line():
    from miles.rollout.rollout_fn import RolloutFunctionError
    from miles.rollout.sglang_rollout import generate_rollout

    with pytest.raises(RolloutFunctionError, match="only inside an --eval-function-path call"):
        generate_rollout(PluginArgs(), 0, None, evaluation=True)


def test_signature_and_defaults(plugins, tmp_path):
    from miles.config import ConfigError
    from miles.run.preflight import check_plugin

    with pytest.raises(ConfigError, match=r"^--eval-function-path 'evalfn_plugins.two_args' has signature "
                                          r"\(args, rollout_id\); expected def generate_rollout\(args, rollout_id, "
                                          r"data_source, evaluation=False\)\.$"):
        check_plugin("eval_function_path", "evalfn_plugins.two_args")
    with pytest.raises(ConfigError, match=r"is a class without __call__; expected class F: def __init__\(self, input"):
        check_plugin("eval_function_path", "miles.rollout.base_types.RolloutFnEvalOutput")
    with pytest.raises(ConfigError, match=r"is a CheckpointEvalFn \(Miles's snapshot-eval backend.*miles does not run it"):
        check_plugin("eval_function_path", "miles.rollout.checkpoint_eval.CheckpointEvalFn")
    check_plugin("eval_function_path", "evalfn_plugins.record")
    # Miles's default eval rollout names select the built-in evaluation: nothing is built, the delegate is refused
    for default in ("miles.rollout.sglang_rollout.generate_rollout",
                    "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn"):
        check_plugin("eval_function_path", default)
        cfg = _cfg(tmp_path, "--eval-prompt-data", "a", "x.jsonl", "--eval-function-path", default)
        assert build_eval_function(cfg, None, None) is None


def test_a_custom_rollout_function_evaluates_when_no_eval_function_is_given(plugins, tmp_path):
    """Miles's default: --eval-function-path unset is --rollout-function-path (called with evaluation=True; its errors
    name that flag); --eval-function-path wins; miles's SFT rollout and Miles's default names leave the built-in eval."""
    from miles.rollout.eval_fn import eval_function_of

    data = ["--eval-prompt-data", "a", "x.jsonl"]
    cfg = _cfg(tmp_path, *data, "--rollout-function-path", "evalfn_plugins.record")
    fn = build_eval_function(cfg, None, None)
    assert fn is not None and eval_function_of(cfg) == ("evalfn_plugins.record", "--rollout-function-path")
    assert asyncio.run(fn.evaluate(1))["eval/mine"] == 0.5 and plugins.calls == [(1, True, None, "NoneType")]
    cfg = _cfg(tmp_path, *data, "--rollout-function-path", "evalfn_plugins.raises")
    with pytest.raises(EvalFunctionError, match=r"^--rollout-function-path evalfn_plugins.raises \(evaluating: "
                                                r"--eval-function-path is unset\) failed: RuntimeError: skills exploded$"):
        asyncio.run(build_eval_function(cfg, None, None).evaluate(0))
    cfg = _cfg(tmp_path, *data, "--rollout-function-path", "evalfn_plugins.raises", "--eval-function-path",
               "evalfn_plugins.as_output")
    assert eval_function_of(cfg) == ("evalfn_plugins.as_output", "--eval-function-path")
    for extra in (["--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss"],
                  ["--rollout-function-path", "evalfn_plugins.record", "--eval-function-path",
                   "miles.rollout.sglang_rollout.generate_rollout"],
                  ["--rollout-function-path", "miles.rollout.sglang_rollout.generate_rollout"], []):
        assert eval_function_of(_cfg(tmp_path, *data, *extra)) is None, extra


@pytest.mark.multiprocess
def test_builtin_evaluate_logs_miles_eval_keys_with_failed_rewards(engine, tok, tmp_path, plugins):
    """The built-in evaluation logs what Miles's log_eval_rollout_data logs for the same data: a sample whose reward
    failed (None) counts 0 in eval/<name> and in eval/<name>-none_reward_ratio."""
    from miles.fleet.client import EngineClient
    from miles.rollout.data import PromptDataset
    from miles.rollout.manager import RolloutManager

    (tmp_path / "rm_plugin.py").write_text(
        "async def every_other(args, sample):\n"
        "    if sample.index % 2:\n        raise RuntimeError('verifier down')\n    return 1.0\n")
    cfg = _cfg(tmp_path, "--custom-rm-path", "rm_plugin.every_other", "--n-samples-per-eval-prompt", "2",
               "--eval-max-response-len", "3", "--input-key", "input")
    dataset = PromptDataset(str(_rows(tmp_path / "e.jsonl", 3)), tok, cfg.data)

    async def main() -> tuple[dict, dict]:
        client = EngineClient(engine)
        try:
            mgr = RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, tok, None, eval_cfg=cfg.eval)
            return await mgr.evaluate_data({"x": dataset}, 0)
        finally:
            await client.close()

    data, m = asyncio.run(main())
    assert data["x"]["rewards"] == [1.0, None] * 3 and len(data["x"]["samples"]) == 6
    assert m["eval/x"] == 0.5 and m["eval/x-none_reward_ratio"] == 0.5 and m["eval/x/reward_failures"] == 3
    assert m["eval/x-truncated_ratio"] == m["eval/x/truncated_ratio"] and m["eval/x/response_len/max"] <= 3


def test_a_timed_out_call_never_reaches_a_later_calls_builtin_eval(plugins, tmp_path):
    """A sync eval function that outlives its bound and then asks for the built-in evaluation gets its own call's
    (closed) handle: the next evaluation's built-in run is not started twice."""
    (tmp_path / "late_plugin.py").write_text(textwrap.dedent('''
        import time
        from miles.rollout.sglang_rollout import generate_rollout as base
        errors = []

        def late(args, rollout_id, data_source, evaluation=False):
            if rollout_id == 0:
                time.sleep(1.5)  # past the bound: abandoned, then asks for the built-in eval
                try:
                    base(args, rollout_id, data_source, evaluation=True)
                except Exception as e:
                    errors.append(str(e))
                return {}
            time.sleep(1.0)  # the stale call's request would land during this one
            return base(args, rollout_id, data_source, evaluation=True)
    '''))
    runs: list[int] = []

    async def builtin(rid: int) -> Any:
        runs.append(rid)
        return {"d": {"rewards": [1.0]}}, {}

    async def main() -> dict:
        fn = EvalFunction("late_plugin.late", PluginArgs(), None, 1, timeout=1.0, builtin=builtin)
        with pytest.raises(EvalFunctionError, match="did not return within"):
            await fn.evaluate(0)
        fn.timeout = 5.0
        return await fn.evaluate(1)

    assert asyncio.run(main()) == {"eval/d": 1.0, "eval/d-none_reward_ratio": 0.0}
    late = sys.modules["late_plugin"]
    assert runs == [1] and late.errors == ["the built-in evaluation was called after its eval function call ended"]
    sys.modules.pop("late_plugin")
