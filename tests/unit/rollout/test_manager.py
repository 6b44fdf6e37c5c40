"""The rollout manager against real embedded engine processes (``python -m miles.engine``).

Covers: full groups with token-in-token-out bookkeeping, visible reward failures, reproducible seeds,
dynamic sampling (all-equal groups dropped, surplus aborted by rid and its prompts given back), a
multi-turn custom generate function with exact ids and loss mask, evaluation, and an engine killed
mid-rollout (the client retries on the other engine; every sample slot filled exactly once).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from miles.config import ConfigError, parse_args
from miles.fleet.client import EngineClient, EngineControl
from miles.rollout.data import DataSource, PromptDataset
from miles.rollout.manager import RolloutError, RolloutManager
from miles.types import SampleStatus
from miles.utils.net import find_free_port

pytestmark = pytest.mark.multiprocess


def launch_engine(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    port = find_free_port()
    proc = subprocess.Popen([sys.executable, "-m", "miles.engine", "--hf-checkpoint", str(model_dir), "--port", str(port),
                             "--weight-version", "3", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_engines(*engines: tuple[subprocess.Popen, str]) -> None:
    async def wait():
        ctls = [EngineControl(url) for _, url in engines]
        try:
            await asyncio.gather(*(c.wait_healthy(180, alive=lambda p=p: p.poll() is None) for c, (p, _) in zip(ctls, engines)))
        finally:
            for c in ctls:
                await c.close()

    try:
        asyncio.run(wait())
    except BaseException:
        for proc, _ in engines:
            stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """Engine A (4 running requests: later ones queue, so dynamic sampling has in-flight surplus to abort)
    and engine B (2 slots), started together; only the last test uses B, and kills it."""
    a, b = launch_engine(tiny_model_dir, "--max-running-requests", "4"), launch_engine(tiny_model_dir, "--max-running-requests", "2")
    try:
        wait_engines(a, b)
        yield a, b
    finally:
        stop(a[0])
        stop(b[0])


@pytest.fixture(scope="module")
def engine(engines):
    return engines[0][1]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


PLUGINS = textwrap.dedent('''
    from miles.rollout.generate import MultiTurn, generate

    async def flaky(args, sample):
        if sample.index % 3 == 0:
            raise RuntimeError("verifier down")
        return float(len(sample.response) % 2)

    async def always_raises(args, sample):
        raise RuntimeError("broken verifier")

    def by_kind(args, sample):
        return 0.0 if sample.metadata["kind"] == "const" else float(sample.index % 2)

    async def two_turns(args, sample, sampling_params):
        turn = MultiTurn(sample, args.tokenizer, {**sampling_params, "max_new_tokens": 40})
        await turn.generate_turn(args.client, max_new_tokens=5)
        turn.add_observation(text="<obs>")
        await turn.generate_turn(args.client, max_new_tokens=6)
        return sample

    async def bad_mask(args, sample, sampling_params):
        await generate(args.client, sample, sampling_params)
        sample.loss_mask = sample.loss_mask[:-1]
        return sample

    def not_async(args, sample, sampling_params):
        return sample

    async def own_prompt(args, sample, sampling_params):
        # Miles's tau-bench form: the function builds its prompt and returns a new Sample, the status as its value
        from miles.utils.types import Sample
        fresh = Sample(prompt="Task: " + sample.prompt, label=sample.label)
        fresh.tokens = args.tokenizer(fresh.prompt, add_special_tokens=False)["input_ids"]
        await generate(args.client, fresh, sampling_params)
        fresh.status = fresh.status.value
        return fresh

    async def three_agents(args, sample, sampling_params):
        # Miles's multi-sample output (its multi-agent example): one sample per agent call, the first one's reward
        # set by the function, the others left to the run's reward
        import copy
        out = []
        for k in range(3):
            one = copy.deepcopy(sample)
            await generate(args.client, one, {**sampling_params, "max_new_tokens": 3 + k})
            out.append(one)
        out[0].reward = 0.5
        return out

    async def empty_list(args, sample, sampling_params):
        return []

    async def no_prompt(args, sample, sampling_params):
        await generate(args.client, sample, sampling_params)
        sample.response_length = len(sample.tokens)
        sample.loss_mask = sample.rollout_log_probs = None
        return sample
''')


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "mgr_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mgr_plugins"


@pytest.fixture
def data_file(tmp_path):
    kinds = ["const", "vary", "const", "vary"] + ["vary"] * 8
    rows = [{"input": f"{i % 10}+{i // 10}=", "label": str(i % 10 + i // 10), "metadata": {"kind": k}}
            for i, k in enumerate(kinds)]
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def config(data_file, *extra: str):
    return parse_args(["--prompt-data", str(data_file), "--label-key", "label", "--num-rollout", "2",
                       "--rollout-max-response-len", "24", *extra])


class RecordingClient(EngineClient):
    """The real client, recording what it sent and got back (for assertions, not a substitute)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.requests: list[tuple[str, list[int], dict]] = []
        self.aborted: list[str] = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, **kw):
        resp = await super().generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid, **kw)
        self.requests.append((rid, list(input_ids), resp))
        return resp

    async def abort(self, rid):
        self.aborted.append(rid)
        return await super().abort(rid)


def build(cfg, client, tok, shuffle=False, progress=None, seed=1):
    dataset = PromptDataset(cfg.data.prompt_data, tok, cfg.data, seed)
    source = DataSource(dataset, shuffle=shuffle, seed=seed)
    return RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, tok, source, eval_cfg=cfg.eval, progress=progress)


def rollout(cfg, engine, tok):
    """Rollout 0 of a manager built from ``cfg`` on a client of ``engine`` (closed after it, also on an error)."""
    async def main():
        client = EngineClient(engine)
        try:
            return await build(cfg, client, tok).generate_rollout(0)
        finally:
            await client.close()

    return asyncio.run(main())


def test_full_groups_token_bookkeeping_and_failures(engine, tok, data_file, plugins):
    cfg = config(data_file, "--rollout-batch-size", "4", "--n-samples-per-prompt", "3",
                 "--custom-rm-path", f"{plugins}.flaky", "--log-passrate")
    progress = []

    async def main():
        client = RecordingClient(engine)
        mgr = build(cfg, client, tok, progress=lambda d, t: progress.append((d, t)))
        res = await mgr.generate_rollout(0)
        await client.close()
        return res, client

    res, client = asyncio.run(main())
    assert [len(g) for g in res.samples] == [3, 3, 3, 3]
    flat = [s for g in res.samples for s in g]
    assert [s.index for s in flat] == list(range(12)) and [s.group_index for s in flat] == [i // 3 for i in range(12)]
    by_rid = {rid: (ids, resp) for rid, ids, resp in client.requests}
    assert len(by_rid) == 12
    for s in flat:
        prompt_ids = tok(s.prompt, add_special_tokens=False)["input_ids"]
        ids, resp = next(v for rid, v in by_rid.items() if f"-g{s.group_index}-s{s.index}-" in rid)
        out = [t for _, t, _ in resp["meta_info"]["output_token_logprobs"]]
        assert ids == prompt_ids and s.tokens == prompt_ids + out, "token ids in and out, no retokenisation"
        assert s.response_length == len(out) and s.loss_mask == [1] * len(out)
        assert s.rollout_log_probs == [lp for lp, _, _ in resp["meta_info"]["output_token_logprobs"]]
        assert s.weight_version == 3
        want = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}[resp["meta_info"]["finish_reason"]["type"]]
        if s.index % 3 == 0:
            assert s.status is SampleStatus.FAILED and s.reward is None
            assert "verifier down" in s.metadata["reward_error"]
        else:
            assert s.status is want and s.reward == float(len(s.response) % 2)
    m = res.metrics
    assert m["rollout/reward_failures"] == 4 and m["rollout/generate_failures"] == 0 and m["rollout/retries"] == 0
    ok = [s for s in flat if s.status is not SampleStatus.FAILED]
    assert m["rollout/raw_reward"] == pytest.approx(sum(s.reward for s in ok) / len(ok))
    assert m["rollout/response_len"] == pytest.approx(sum(s.response_length for s in flat) / 12)
    assert m["rollout/truncated_ratio"] == pytest.approx(sum(s.status is SampleStatus.TRUNCATED for s in flat) / 12)
    assert m["perf/rollout_time"] > 0
    assert progress[-1] == (12, 12) and len(progress) == 12
    # --log-passrate: pass@k = 1 - C(n - c, k) / C(n, k) per group of 3 (c: rewards of 1; a failed sample fails), k 1, 2
    for k in (1, 2):
        c = [sum(s.reward == 1 for s in g) for g in res.samples]
        assert m[f"passrate/pass@{k}"] == pytest.approx(sum(1 - math.comb(3 - x, k) / math.comb(3, k) for x in c) / 4)
    assert "passrate/pass@4" not in m


def test_every_sample_failing_is_an_error_and_bad_plugins_fail_at_startup(engine, tok, data_file, plugins):
    cfg = config(data_file, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--custom-rm-path", f"{plugins}.always_raises")

    with pytest.raises(RolloutError, match="every one of 4 samples failed; first error: reward: RuntimeError: broken verifier"):
        rollout(cfg, engine, tok)
    with pytest.raises(ConfigError, match="--custom-generate-function-path .*not_async.* must be a coroutine function"):
        build(config(data_file, "--rollout-batch-size", "2", "--rm-type", "exact_match",
                     "--custom-generate-function-path", f"{plugins}.not_async"), None, tok)
    with pytest.raises(ConfigError, match="--dynamic-sampling-filter-path 'miles.rollout.filters.nope'"):
        build(config(data_file, "--rollout-batch-size", "2", "--rm-type", "exact_match",
                     "--dynamic-sampling-filter-path", "miles.rollout.filters.nope"), None, tok)


def test_seeds_make_rollouts_reproducible(engine, tok, data_file):
    cfg = config(data_file, "--rollout-batch-size", "3", "--n-samples-per-prompt", "3", "--rm-type", "exact_match",
                 "--rollout-shuffle", "--rollout-seed", "11")

    async def one(rollout_id):
        client = EngineClient(engine)
        res = await build(cfg, client, tok, shuffle=True, seed=11).generate_rollout(rollout_id)
        await client.close()
        return [[s.tokens for s in g] for g in res.samples]

    a, b, c = asyncio.run(one(5)), asyncio.run(one(5)), asyncio.run(one(6))
    assert a == b, "same seed, rollout id and weights -> the same samples"
    assert a != c
    assert any(len({tuple(t) for t in g}) > 1 for g in a), "samples of a group get distinct seeds"


def test_dynamic_sampling_drops_equal_groups_and_aborts_surplus(engine, tok, data_file, plugins):
    cfg = config(data_file, "--rollout-batch-size", "2", "--over-sampling-batch-size", "8", "--n-samples-per-prompt",
                 "2", "--custom-rm-path", f"{plugins}.by_kind", "--rollout-max-response-len", "64",
                 "--dynamic-sampling-filter-path", "miles.rollout.filters.check_reward_nonzero_std")

    async def main():
        client = RecordingClient(engine)
        mgr = build(cfg, client, tok)
        res = await mgr.generate_rollout(0)
        nxt = mgr.data_source.next_batch(1)
        await client.close()
        return res, client, mgr, nxt

    res, client, mgr, nxt = asyncio.run(main())
    assert [g[0].group_index for g in res.samples] == [1, 3], "first two passing groups in launch order"
    for g in res.samples:
        assert len({s.reward for s in g}) == 2
    m = res.metrics
    assert m["rollout/dynamic_filter/drop_zero_std"] == 2 and m["rollout/groups_launched"] == 8
    assert m["rollout/surplus_aborted_requests"] == len(client.aborted) > 0
    assert all("-g" in rid and int(rid.split("-g")[1].split("-")[0]) >= 4 for rid in client.aborted)
    finishes = [resp["meta_info"]["finish_reason"]["type"] for rid, _, resp in client.requests if rid in client.aborted]
    assert "abort" in finishes, "the engine stopped the aborted requests"
    # surplus prompts (groups 4-7) go back to the data source and are served next
    assert mgr.data_source.state_dict()["buffer"][:3] == [5, 6, 7] and nxt[0].index == 4


def test_multi_turn_custom_generate_keeps_ids_exact(engine, tok, data_file, plugins):
    cfg = config(data_file, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rm-type", "exact_match",
                 "--custom-generate-function-path", f"{plugins}.two_turns")

    async def main():
        client = RecordingClient(engine)
        res = await build(cfg, client, tok).generate_rollout(0)
        await client.close()
        return res, client

    res, client = asyncio.run(main())
    obs = tok("<obs>", add_special_tokens=False)["input_ids"]
    assert [len(g) for g in res.samples] == [2, 2]      # 2 prompts x 2 samples: the loop below checks every one
    for s in (s for g in res.samples for s in g):
        reqs = sorted((r for r in client.requests if f"-s{s.index}-" in r[0]), key=lambda r: int(r[0].rsplit("-", 1)[1]))
        assert len(reqs) == 2
        (_, in1, out1), (_, in2, out2) = reqs
        t1 = [t for _, t, _ in out1["meta_info"]["output_token_logprobs"]]
        t2 = [t for _, t, _ in out2["meta_info"]["output_token_logprobs"]]
        prompt = tok(s.prompt, add_special_tokens=False)["input_ids"]
        assert in1 == prompt and in2 == prompt + t1 + obs, "turn 2 sees exactly turn 1's ids plus the observation"
        assert s.tokens == in2 + t2 and s.response_length == len(t1) + len(obs) + len(t2)
        assert s.loss_mask == [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
        lp = [x for x, _, _ in out1["meta_info"]["output_token_logprobs"]]
        assert s.rollout_log_probs == lp + [0.0] * len(obs) + [x for x, _, _ in out2["meta_info"]["output_token_logprobs"]]
        assert s.response == tok.decode(s.tokens[len(prompt):], skip_special_tokens=False)
    cfg = config(data_file, "--rollout-batch-size", "2", "--rm-type", "exact_match",
                 "--custom-generate-function-path", f"{plugins}.bad_mask")

    with pytest.raises(RolloutError, match="bad_mask: loss_mask has .* entries, expected response_length"):
        rollout(cfg, engine, tok)


def test_a_generate_function_may_build_its_own_prompt(engine, tok, data_file, plugins):
    """Miles's tau-bench agent templates its environment's first message as the prompt (the data's prompt is a task
    index) and returns a new Sample whose status is a string: accepted; a sample with no prompt id is refused."""
    cfg = config(data_file, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rm-type", "exact_match",
                 "--custom-generate-function-path", f"{plugins}.own_prompt")

    res = rollout(cfg, engine, tok)
    assert [len(g) for g in res.samples] == [2, 2]      # 2 prompts x 2 samples: the loop below checks every one
    for s in (s for g in res.samples for s in g):
        prompt = tok(s.prompt, add_special_tokens=False)["input_ids"]
        assert s.prompt.startswith("Task: ") and s.tokens[:len(prompt)] == prompt
        assert s.prompt_length == len(prompt) and s.response_length > 0
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and isinstance(s.status, SampleStatus)
        assert s.reward is not None
    cfg = config(data_file, "--rollout-batch-size", "2", "--rm-type", "exact_match",
                 "--custom-generate-function-path", f"{plugins}.no_prompt")
    with pytest.raises(RolloutError, match="no_prompt: tokens .* must be the prompt ids followed by response_length "
                                           ".* with at least one prompt id"):
        rollout(cfg, engine, tok)


def test_a_generate_function_may_return_several_samples_for_its_slot(engine, tok, data_file, plugins):
    """Miles's multi-sample output: each slot's samples join its group (3 per slot here), each keeps the slot's group,
    index and rollout, is rewarded unless the function set its reward, and counts in the rollout's metrics; an empty
    list fails its slots, naming what is expected."""
    cfg = config(data_file, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rm-type", "exact_match",
                 "--custom-generate-function-path", f"{plugins}.three_agents")

    res = rollout(cfg, engine, tok)
    assert [len(g) for g in res.samples] == [6, 6]
    for g in res.samples:
        assert len({s.group_index for s in g}) == 1 and [s.index for s in g] == [g[0].index] * 3 + [g[3].index] * 3
        for k, s in enumerate(g):
            prompt = tok(s.prompt, add_special_tokens=False)["input_ids"]
            assert s.tokens[:len(prompt)] == prompt and 0 < s.response_length <= 3 + k % 3
            assert s.rollout_id == 0 and s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
            assert (s.reward == 0.5) if k % 3 == 0 else (s.reward in (0.0, 1.0))
    assert res.metrics["rollout/num_samples"] == 12 and 0 < res.metrics["rollout/response_len_max"] <= 5
    cfg = config(data_file, "--rollout-batch-size", "2", "--rm-type", "exact_match",
                 "--custom-generate-function-path", f"{plugins}.empty_list")
    with pytest.raises(RolloutError, match=r"empty_list: returned list, expected a Sample \(or a non-empty list"):
        rollout(cfg, engine, tok)


def test_a_filter_that_keeps_nothing_reports_and_ends_after_one_pass(engine, tok, tmp_path, plugins, caplog):
    """Every group's rewards equal: a progress line each FILTER_REPORT_EVERY x --rollout-batch-size groups naming the
    filter and the kept count, then after one pass over the data one RolloutError (Miles would go on forever)."""
    data = tmp_path / "const.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1), "metadata": {"kind": "const"}}) + "\n"
                            for i in range(12)))
    cfg = config(data, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                 "--custom-rm-path", f"{plugins}.by_kind",
                 "--dynamic-sampling-filter-path", "miles.rollout.filters.check_reward_nonzero_std")

    with caplog.at_level("INFO", logger="miles"), pytest.raises(
            RolloutError, match=r"rollout 0: the dynamic sampling filter miles.rollout.filters.check_reward_nonzero_std "
                                r"kept 0 of 14 groups \(drops: \{'zero_std': \d+\}\) without reaching "
                                r"--rollout-batch-size 2"):
        rollout(cfg, engine, tok)
    lines = [r.getMessage() for r in caplog.records if "finished groups so far" in r.getMessage()]
    assert len(lines) == 1, lines   # 8 groups launched (4 x --rollout-batch-size 2); the 14th ends the rollout
    assert lines[0].startswith("rollout 0: the dynamic sampling filter miles.rollout.filters.check_reward_nonzero_std "
                               "kept 0 of ") and "launching 2 more (at most 14 groups, one pass over the data)" in lines[0]


def test_evaluate(engine, tok, data_file):
    cfg = config(data_file, "--rollout-batch-size", "2", "--rm-type", "exact_match", "--n-samples-per-eval-prompt", "2",
                 "--eval-max-response-len", "4", "--eval-temperature", "0", "--log-passrate")

    async def main():
        client = EngineClient(engine)
        mgr = build(cfg, client, tok)
        out = await mgr.evaluate_data({"tiny": mgr.data_source.dataset}, rollout_id=3)
        await client.close()
        return out

    data, m = asyncio.run(main())
    assert m["eval/tiny/num_samples"] == 24 and m["eval/tiny/response_len_max"] <= 4
    assert m["eval/tiny"] == m["eval/tiny/raw_reward"] and m["eval/tiny/reward_failures"] == 0
    # --log-passrate: eval/<name>-pass@k over each prompt's 2 samples (Miles's keys)
    rewards = data["tiny"]["rewards"]
    c = [sum(r == 1 for r in rewards[i:i + 2]) for i in range(0, 24, 2)]
    assert m["eval/tiny-pass@1"] == pytest.approx(sum(rewards) / 24)
    assert m["eval/tiny-pass@2"] == pytest.approx(sum(x > 0 for x in c) / 12)


def test_evaluate_eval_config_datasets_each_with_their_own_settings(engine, tok, data_file, tmp_path):
    """--eval-config with two datasets of different n / temperature / max_response_len / rm_type: each dataset's
    requests carry its sampling params, its samples its rm_type and metadata overrides, and eval/<name> counts
    its prompts x its n."""
    from miles.config.eval_datasets import resolve_eval_datasets
    from miles.rollout.data import load_eval_datasets
    from miles.rollout.rewards import register_reward

    @register_reward("eval_cfg_test_tagged", overwrite=True)
    def tagged(args, sample):  # 1.0 when the dataset's metadata_overrides reached the sample
        return 1.0 if sample.metadata.get("tag") == "b" else 0.0

    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:7]))
    doc = {"eval": {"defaults": {"top_p": 0.9},
                    "datasets": [{"name": "a", "path": str(tmp_path / "a.jsonl"), "n_samples_per_eval_prompt": 2,
                                  "temperature": 0.0, "max_response_len": 3, "rm_type": "exact_match"},
                                 {"name": "b", "path": str(tmp_path / "b.jsonl"), "n_samples_per_eval_prompt": 3,
                                  "temperature": 1.0, "max_response_len": 5, "rm_type": "eval_cfg_test_tagged",
                                  "metadata_overrides": {"tag": "b"}}]}}
    (tmp_path / "eval.yaml").write_text(json.dumps(doc))
    cfg = config(data_file, "--rollout-batch-size", "2", "--rm-type", "math", "--eval-config", str(tmp_path / "eval.yaml"))
    datasets = load_eval_datasets(resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout), cfg.eval, cfg.data, tok)

    async def main():
        client = RecordingClient(engine)
        sent: list[dict] = []
        inner = client.generate

        async def recording(input_ids, sampling_params, **kw):
            sent.append(dict(sampling_params))
            return await inner(input_ids, sampling_params, **kw)
        client.generate = recording
        mgr = build(cfg, client, tok)
        out = await mgr.evaluate(datasets, rollout_id=0)
        await client.close()
        return out, sent

    m, sent = asyncio.run(main())
    assert m["eval/a/num_samples"] == 4 * 2 and m["eval/b/num_samples"] == 3 * 3
    assert m["eval/a/response_len_max"] <= 3 and m["eval/b/response_len_max"] <= 5
    assert m["eval/a/reward_failures"] == 0 and m["eval/b/reward_failures"] == 0
    assert m["eval/b"] == 1.0 and m["eval/a"] == m["eval/a/raw_reward"]  # b scored by its own rm_type
    by_len = {p["max_new_tokens"]: p for p in sent}
    assert sorted(p["max_new_tokens"] for p in sent) == [3] * 8 + [5] * 9
    assert by_len[3]["temperature"] == 0.0 and by_len[5]["temperature"] == 1.0
    assert by_len[3]["top_p"] == by_len[5]["top_p"] == 0.9  # eval.defaults


def test_samples_aborted_by_the_engine_are_generated_again(engine, tok, data_file):
    """An engine-side abort (e.g. a weight update pausing with mode=abort) is not a finished sample."""
    cfg = config(data_file, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rm-type", "exact_match",
                 "--rollout-max-response-len", "48")
    fired = []

    async def main():
        client, ctl = EngineClient(engine), EngineControl(engine)

        def progress(done, total):
            if not fired:  # 16 requests, 4 running: the rest are in flight when the first finishes
                fired.append(asyncio.ensure_future(ctl.abort_all()))

        try:
            res = await build(cfg, client, tok, progress=progress).generate_rollout(0)
            await fired[0]
            return res
        finally:
            await client.close()
            await ctl.close()

    res = asyncio.run(main())
    flat = [s for g in res.samples for s in g]
    assert res.metrics["rollout/engine_abort_retries"] >= 1
    assert sorted(s.index for s in flat) == list(range(16))
    assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in flat)


@pytest.mark.slow
def test_engine_killed_mid_rollout_is_retried_elsewhere(engines, tok, data_file):
    (_, engine), (proc_b, url_b) = engines
    cfg = config(data_file, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rm-type", "exact_match",
                 "--rollout-max-response-len", "48")
    killed = []

    def progress(done, total):
        if not killed:
            os.kill(proc_b.pid, signal.SIGKILL)  # B still holds queued requests (2 slots, 8 requests)
            killed.append(done)

    async def main():
        client = EngineClient([engine, url_b], max_retries=3, backoff=0.05)
        try:
            return await build(cfg, client, tok, progress=progress).generate_rollout(0)
        finally:
            await client.close()

    res = asyncio.run(main())
    flat = [s for g in res.samples for s in g]
    assert killed and sorted(s.index for s in flat) == list(range(16)), "every slot filled exactly once"
    assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in flat)
    assert res.metrics["rollout/retries"] >= 1 and res.metrics["rollout/generate_failures"] == 0
