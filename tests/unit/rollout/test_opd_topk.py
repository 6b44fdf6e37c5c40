"""Top-k OPD (--opd-log-prob-top-k K): the reverse-KL estimate per strategy and weight mode on hand-made
answers; the whole path on a real embedded engine (student top-K kept by the default generate, the teacher's
log-probs of those ids from a prefill, the student's of the teacher's ids) against a reference forward of the
same HF model; the trainer's advantages take the estimate; the flags' refusals."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.rollout import opd_topk
from miles.types import Sample

BASE = ["--num-rollout", "1", "--rollout-batch-size", "2"]
OPD = ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://127.0.0.1:9/generate",
       "--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func",
       "--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards"]


def _args(strategy: str, mode: str = "student_p", k: int = 2) -> SimpleNamespace:
    return SimpleNamespace(use_opd=True, opd_log_prob_top_k=k, opd_top_k_strategy=strategy, opd_reward_weight_mode=mode)


def _entries(d: dict[int, float]) -> list[list]:
    return [[lp, i, None] for i, lp in d.items()]


# one response position; student top-2 {1, 2}, teacher top-2 {2, 3}
S_TOP = {1: math.log(0.6), 2: math.log(0.3)}
T_TOP = {2: math.log(0.5), 3: math.log(0.4)}
T_ON_S = {1: math.log(0.05), 2: math.log(0.5)}
S_ON_T = {2: math.log(0.3), 3: math.log(0.02)}


def _sample_and_answer():
    s = Sample(tokens=[7, 8, 9], response_length=1, metadata={"opd_student_top_logprobs": [_entries(S_TOP)]})
    placeholder = [None]  # SGLang's first input position; then the prompt positions, then the response's
    teacher = {"meta_info": {"input_top_logprobs": placeholder + [[], _entries(T_TOP)],
                             "input_token_ids_logprobs": placeholder + [[], _entries(T_ON_S)]}}
    student = {"meta_info": {"input_token_ids_logprobs": placeholder + [[], _entries(S_ON_T)]}}
    return s, {"teacher": teacher, "student_on_teacher": student}


def _expected(ids, s, t, mode, normalize):
    sl, tl = [s[i] for i in ids], [t[i] for i in ids]
    base = sl if mode == "student_p" else tl if mode == "teacher_p" else [0.0] * len(ids)
    w = [math.exp(x) for x in base]
    if normalize:
        w = [x / sum(w) for x in w]
    return sum(wi * (a - b) for wi, a, b in zip(w, sl, tl))


@pytest.mark.parametrize("mode", ["student_p", "teacher_p", "none"])
@pytest.mark.parametrize("strategy, ids, normalize", [
    ("only-student", [1, 2], True), ("only-teacher", [2, 3], True), ("intersection", [2], True),
    ("union", [1, 2, 3], True), ("xor", [1, 3], False)])
def test_reverse_kl_per_strategy_and_weight_mode(strategy, ids, normalize, mode):
    sample, answer = _sample_and_answer()
    s_all, t_all = {**S_ON_T, **S_TOP}, {**T_ON_S, **T_TOP}
    got = opd_topk.reverse_kl(_args(strategy, mode), sample, answer)
    assert got == pytest.approx([_expected(ids, s_all, t_all, mode, normalize)], rel=1e-12)


def test_miles_private_helper_names_are_this_implementation():
    """Miles's tests/fast/rollout/test_on_policy_distillation.py imports the OPD module's private helpers: the same
    reverse KL as a float32 tensor, the request bodies, the per-position id lists, the routing."""
    from miles.rollout import on_policy_distillation as opd

    sample, answer = _sample_and_answer()
    got = opd._compute_topk_reverse_kl(_args("union"), sample, answer)
    # float32 against the float64 list: measured 1.6e-8 relative (CPU, 2026-12-07)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(opd_topk.reverse_kl(_args("union"), sample,
                                                                                          answer), rel=3e-8)
    assert opd._per_position_ids([_entries(S_TOP), []], prompt_len=2) == [[], [], [1, 2], []]
    flat = opd._score_payload([1, 2], top_k=3, token_ids=[5])
    assert flat["top_logprobs_num"] == 3 and flat["token_ids_logprob"] == [5] and flat["input_ids"] == [1, 2]
    assert flat["sampling_params"]["max_new_tokens"] == 0 and flat["logprob_start_len"] == 0
    per = opd._score_payload([1, 2], token_ids=[5], token_ids_positions=[[], [5]])
    assert per["token_ids_logprob_positions"] == [[], [5]] and "token_ids_logprob" not in per
    assert opd._score_payload([1]) == opd.score_payload([1]) and opd._teacher_url_for_sample is opd.teacher_url


def test_missing_pieces_are_named():
    sample, answer = _sample_and_answer()
    sample.metadata.clear()
    with pytest.raises(opd_topk.TeacherError, match="student's top-K log-probs of each of its 1 response tokens"):
        opd_topk.reverse_kl(_args("only-student"), sample, answer)
    sample, answer = _sample_and_answer()
    del answer["teacher"]["meta_info"]["input_token_ids_logprobs"]
    with pytest.raises(opd_topk.TeacherError, match="no meta_info.input_token_ids_logprobs"):
        opd_topk.reverse_kl(_args("only-student"), sample, answer)


def test_flags():
    assert parse_args(BASE + OPD + ["--opd-log-prob-top-k", "4"]).algo.opd_log_prob_top_k == 4
    for extra, match in ((["--opd-log-prob-top-k", "-1"], "must be >= 0"),
                         (["--opd-log-prob-top-k", "4", "--opd-topk-per-position"], "patched SGLang")):
        with pytest.raises(ConfigError, match=match):
            parse_args(BASE + OPD + extra)
    with pytest.raises(ConfigError, match="^--opd-log-prob-top-k 4 .top-k OPD. runs through Miles's OPD plugin"):
        parse_args(BASE + ["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "http://h:1/generate",
                           "--opd-log-prob-top-k", "4"])
    args = parse_args(BASE + OPD + ["--opd-log-prob-top-k", "4"]).algo
    assert opd_topk.student_top_k(args) == 4
    assert opd_topk.student_top_k(parse_args(BASE + OPD + ["--opd-log-prob-top-k", "4", "--opd-top-k-strategy",
                                                          "only-teacher"]).algo) == 0


def test_advantages_take_the_estimate():
    from miles.trainer.advantages import AdvantageInputs, compute_advantages_and_returns

    algo = parse_args(BASE + OPD + ["--opd-log-prob-top-k", "4", "--opd-kl-coef", "0.5"]).algo
    rkl = [torch.tensor([0.2, -0.1]), torch.tensor([0.4, 0.0])]
    inp = AdvantageInputs(rewards=torch.zeros(2), group_ids=[0, 0], loss_masks=[torch.ones(2), torch.ones(2)],
                          log_probs=[torch.zeros(2), torch.zeros(2)], opd_reverse_kl=rkl)
    adv, _, extras = compute_advantages_and_returns(algo, inp)
    for a, k in zip(adv, rkl):
        torch.testing.assert_close(a, -0.5 * k, rtol=0, atol=0)      # measured: bit for bit (CPU)
    torch.testing.assert_close(extras["opd_reverse_kl"][1], rkl[1], rtol=0, atol=0)


# ------------------------------------------------------------------ on a real engine

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from miles.engine.testing import EngineProc, build_engine_model

    model = build_engine_model(tmp_path_factory.mktemp("engine_model"))
    e = EngineProc(model, "--max-running-requests", "4", "--max-context-len", "256", "--random-seed", "0",
                   log=tmp_path_factory.mktemp("engine_log") / "engine.log")
    yield e, model
    e.stop()


@pytest.mark.parametrize("strategy", ["only-student", "union"])
def test_topk_opd_on_a_real_engine_matches_a_reference_forward(engine, strategy):
    """Student and teacher are the same model, sampled at temperature 0.7 (the student's top-K log-probs are
    under the tempered distribution, the teacher's prefill under the plain one), so the estimate is not zero
    and equals the one computed from HF logits. With ``union`` the student's engines are also asked for their
    log-probs of the teacher's ids (one model: the two top-K sets coincide, so those answers are not used)."""
    from transformers import AutoModelForCausalLM

    from miles.fleet.client import EngineClient
    from miles.rollout import generate as gen
    from miles.rollout.on_policy_distillation import post_process_rewards, reward_func

    eng, model_dir = engine
    T, K, prompt = 0.7, 3, [5, 6, 7, 8]
    args = SimpleNamespace(use_opd=True, opd_log_prob_top_k=K, opd_top_k_strategy=strategy,
                           opd_reward_weight_mode="student_p", rm_url=eng.url + "/generate", rm_timeout=60.0,
                           rm_max_retries=1, opd_teacher_urls=None, reward_key=None)

    async def run() -> Sample:
        async with EngineClient(eng.url, timeout=60, max_retries=1) as client:
            args.client = client
            sample = Sample(tokens=list(prompt), index=0)
            params = {"max_new_tokens": 6, "temperature": T, "ignore_eos": True, "sampling_seed": 3}
            await gen.generate(client, sample, params, top_logprobs_num=opd_topk.student_top_k(args))
            sample.reward = await reward_func(args, sample)
            post_process_rewards(args, [sample])
            return sample

    sample = asyncio.run(run())
    got = sample.metadata["opd_reverse_kl"]
    assert len(got) == sample.response_length == 6 and len(sample.metadata["opd_student_top_logprobs"]) == 6
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([sample.tokens])).logits[0].float()
    want = []
    for t in range(6):
        row = logits[len(prompt) - 1 + t]
        s_lp, t_lp = torch.log_softmax(row / T, -1), torch.log_softmax(row, -1)
        ids = s_lp.topk(K).indices.tolist()
        if strategy == "union":
            ids = list(dict.fromkeys(ids + t_lp.topk(K).indices.tolist()))
        w = torch.softmax(s_lp[ids], -1)
        want.append(float((w * (s_lp[ids] - t_lp[ids])).sum()))
    assert got == pytest.approx(want, abs=2e-6)                          # measured 9.6e-7 (CPU, 2026-12-07)
    assert max(abs(x) for x in want) > 1e-3
