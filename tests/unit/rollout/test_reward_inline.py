"""Built-in string rewards (``quickstart``, ``exact_match``) run on the event loop: no thread per sample."""

from __future__ import annotations

import asyncio
import threading

from miles.config import parse_args
from miles.rollout.rewards import Rewarder
from miles.types import Sample, SampleStatus


def rewarder(rm_type: str) -> Rewarder:
    return Rewarder(parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--rm-type", rm_type],
                               validate=False).reward)


def test_string_builtins_start_no_thread_and_still_fail_visibly(monkeypatch):
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self))[1])
    q, e, m = rewarder("quickstart"), rewarder("exact_match"), rewarder("math")
    qs = [Sample(response=r, label="7", status=SampleStatus.COMPLETED) for r in ("7<|endoftext|>", " 7 ", "77")]
    es = [Sample(response=" 42\n", label="42", status=SampleStatus.COMPLETED)]
    no_label = Sample(response="7", label=None, status=SampleStatus.COMPLETED)
    ms = [Sample(response="\\boxed{12}", label="12", status=SampleStatus.COMPLETED)]

    async def go():
        a = await asyncio.gather(*(q.score_sample(s) for s in qs), e.score_sample(es[0]), q.score_sample(no_label))
        inline_threads = list(started)
        b = await m.score_sample(ms[0])
        return a, inline_threads, b

    ok, inline_threads, math_ok = asyncio.run(go())
    assert inline_threads == [], "string built-ins are called inline"
    assert [s.reward for s in qs] == [1.0, 1.0, 0.0] and es[0].reward == 1.0
    assert ok == [True, True, True, True, False] and no_label.status is SampleStatus.FAILED
    assert "label" in no_label.metadata["reward_error"]
    assert math_ok and ms[0].reward == 1 and any(n.startswith("miles-plugin") for n in started), \
        "other built-ins still run bounded on a thread"
