"""Every measured figure the docs quote is backed: a number with a unit (tok/s, s, ms, GiB, %, x, TFLOP/s,
"passed", ...) or a parity figure (``4.8e-7``) in README.md, examples/*/README.md or docs/*.md must appear in
docs/benchmarks.md (whose tables give the command, machine and date) or in a run log under benchmarks/results/;
a parity figure or a percentage may instead sit in a test under tests/ (the bound it checks, or the comment beside
the bound naming what was measured). Design values (defaults, timeouts, bounds a test asserts) are listed in
ALLOWED, each with why it is not a measurement. Fenced code blocks are skipped: they are commands and transcripts.

The check is a net, not a proof: a figure with three or more digits is found bare (table cells carry their unit in
the header), a shorter one only with its unit, so a common small figure can match by chance."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = "docs/benchmarks.md"

_NUM = r"(?<![\w.,/-])(\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?)"
_UNIT = (r"(\s?(?:tok/s|tokens/s|TFLOP/s|GB/s|TB/s|GiB|MiB|KiB|GB|MB|TB|ms|us)"   # 12,345 tok/s, 5.8GiB
         r"|%|x"                                                                    # 37.7%, 2.8x (not "1 x DP")
         r"|\s(?:s|seconds|minutes|min|passed|failed|skipped))")                   # 36-50 s (not HTTP 400s)
FIGURE = re.compile(_NUM + _UNIT + r"(?![\w/])")
PARITY = re.compile(r"(?<![\w.])(\d(?:\.\d+)?e-\d+)(?!\d)")
_SAME_UNIT = {"tok/s": "tok/s|tokens/s", "tokens/s": "tok/s|tokens/s", "s": "s|seconds", "seconds": "s|seconds",
              "minutes": "minutes|min", "min": "minutes|min"}

# (file, figure as written) -> why it is not a measurement. Keep it short: a measured figure belongs in
# docs/benchmarks.md, not here. An entry that no longer matches a figure of its file fails the test.
ALLOWED = {
    ("README.md", "10 minutes"): "the quickstart test's time bound (tests/e2e/test_quickstart.py)",
    ("examples/quickstart/README.md", "10 minutes"): "the quickstart test's time bound",
    ("examples/quickstart/README.md", "20%"): "the share of right demonstrations build.py writes",
    ("examples/quickstart/README.md", "80%"): "the share of off-by-one demonstrations build.py writes",
    ("examples/quickstart/README.md", "30%"): "a rejected teacher's share of right answers (a setting)",
    ("docs/architecture.md", "30%"): "the bound tests/unit/config/test_bad_inputs.py asserts",
    ("docs/data-and-rewards.md", "8 MiB"): "--rollout-max-prompt-bytes' default",
    ("docs/data-and-rewards.md", "60 s"): "--rm-timeout's default",
    ("docs/data-and-rewards.md", "3600 s"): "--custom-generate-function-timeout's default",
    ("docs/data-and-rewards.md", "32 MiB"): "the size above which samples travel as a tensor (a constant)",
    ("docs/engine-protocol.md", "20 s"): "the /health window of a recent step (a constant)",
    ("docs/engine-protocol.md", "3 s"): "the stop watchdog's delay after a signal (a constant)",
    ("docs/fault-tolerance.md", "0 s"): "--rollout-health-check-first-wait's default",
    ("docs/fault-tolerance.md", "90 s"): "interval + 2 x timeout at the defaults (30 s each)",
    ("docs/fault-tolerance.md", "40 min"): "--rollout-request-timeout x (retries + 1) at the defaults",
    ("docs/fault-tolerance.md", "3 s"): "the tests' --rollout-health-check-timeout 3, and a 3 s margin on a bound",
    ("docs/fault-tolerance.md", "4 s"): "the margin the FT e2e adds to the computed bounds",
    ("docs/fault-tolerance.md", "7 s"): "interval + 2 x timeout at the test's 1 s / 3 s setting (computed)",
    ("docs/fault-tolerance.md", "0.25 s"): "the probe period while an engine starts (a constant)",
    ("docs/fault-tolerance.md", "0.1-1 s"): "the heartbeat period's clamp in miles/ft/timing.py",
    ("docs/fault-tolerance.md", "9 s"): "FTTimings' kill bound at the defaults (computed, not measured)",
    ("docs/fault-tolerance.md", "4.5 s"): "FTTimings' kill bound with a 1 s interval (computed)",
    ("docs/fault-tolerance.md", "69 s"): "FTTimings.hang_detection_bound at the defaults (computed)",
    ("docs/fault-tolerance.md", "3600 s"): "--custom-generate-function-timeout's default",
    ("docs/fault-tolerance.md", "15 s"): "--distributed-timeout-minutes 0.25, the test's setting",
    ("docs/fault-tolerance.md", "35 s"): "the bound tests/e2e/test_run_errors.py asserts",
    ("docs/fault-tolerance.md", "20 s"): "--ft-rank-heartbeat-timeout in the ft_launcher test",
    ("docs/fault-tolerance.md", "60 s"): "the bound the ft_launcher test asserts",
    ("docs/flags.md", "30 minutes"): "sglang-router's help text for its default",
    ("docs/flags.md", "50MB"): "sglang-router's help text for its default",
    ("docs/flags.md", "1e-06"): "--lr's default",
    ("docs/flags.md", "1e-08"): "--adam-eps' default",
    ("docs/launching.md", "0.2 s"): "the lifeline thread's polling period (a constant)",
    ("docs/launching.md", "60 s"): "the bound the bad-plan test asserts",
    ("docs/launching.md", "8 s"): "the bound the test allows torch_shm_manager",
    ("docs/trainer.md", "5 GB"): "the HF export's shard size (a constant)",
    ("docs/weight-sync.md", "7,227.3 ms"): "Miles's published figure, cited with its source",
    ("docs/weight-sync.md", "53,279.1 ms"): "Miles's published figure, cited with its source",
}


def quoted_figures(text: str) -> list[str]:
    """The figures ``text`` quotes (code blocks skipped), as written: ``"36-50 s"``, ``"37.7%"``, ``"4.8e-7"``."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found = [m.group(1) + m.group(2) for m in FIGURE.finditer(prose)]
    return found + PARITY.findall(prose)


def is_backed(figure: str, backing: str, tests: str) -> bool:
    """Whether ``figure`` appears in ``backing`` (docs/benchmarks.md and benchmarks/results/) with its unit, or bare
    when it has three or more digits; a parity figure or a percentage may also appear in ``tests``."""
    if PARITY.fullmatch(figure):
        return any(re.search(rf"(?<![\w.]){re.escape(figure)}(?!\d)", t) for t in (backing, tests))
    m = FIGURE.fullmatch(figure)
    assert m, figure
    num, unit = m.group(1), m.group(2).strip()
    units = _SAME_UNIT.get(unit, re.escape(unit))
    lead = r"(?<![\w.,/-])" + re.escape(num)
    texts = (backing, tests) if unit == "%" else (backing,)
    for t in texts:
        if re.search(lead + rf"\s?(?:{units})(?![\w/])", t):
            return True
    return sum(c.isdigit() for c in num) >= 3 and re.search(lead + r"(?![\d.,]\d)", backing) is not None


def _sources() -> list[str]:
    docs = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    examples = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "examples").glob("*/README.md"))
    return ["README.md", *examples, *(d for d in docs if d != BENCHMARKS)]


def _backing() -> tuple[str, str]:
    results = sorted(p for p in (REPO / "benchmarks" / "results").rglob("*") if p.is_file())
    backing = "\n".join([(REPO / BENCHMARKS).read_text(), *(p.read_text(errors="replace") for p in results)])
    tests = "\n".join(p.read_text(errors="replace") for p in sorted((REPO / "tests").rglob("*.py")))
    return backing, tests


def unbacked(sources: dict[str, str], backing: str, tests: str) -> list[str]:
    bad = []
    for f, text in sources.items():
        for fig in quoted_figures(text):
            if (f, fig) not in ALLOWED and not is_backed(fig, backing, tests):
                bad.append(f"{f}: {fig!r} is in no table of {BENCHMARKS}, no file of benchmarks/results/ (nor a test)")
    return bad


def test_every_quoted_figure_is_backed():
    sources = {f: (REPO / f).read_text() for f in _sources()}
    bad = unbacked(sources, *_backing())
    assert not bad, ("figures without a recorded measurement (add the run to docs/benchmarks.md with command, "
                     "machine and date, quote it as recorded, or list a design value in ALLOWED):\n" + "\n".join(bad))


def test_allowed_entries_are_still_quoted():
    """An ALLOWED entry whose figure left its file is dropped, so the list stays short and true."""
    stale = [k for k in ALLOWED if k[1] not in quoted_figures((REPO / k[0]).read_text())]
    assert not stale, f"ALLOWED entries no longer in their file: {stale}"


def test_the_checker_catches_an_unbacked_figure():
    """A synthetic doc with a figure nowhere recorded fails; the same figure recorded in the backing passes."""
    doc = {"docs/x.md": "The engine does 12,345 tok/s and a sync takes 4.2 s; parity 3.3e-9; MFU 41.5%.\n"
                        "```\n$ run  # 99.9 s in a transcript is skipped\n```\n"}
    assert quoted_figures(doc["docs/x.md"]) == ["12,345 tok/s", "4.2 s", "41.5%", "3.3e-9"]
    assert len(unbacked(doc, backing="", tests="")) == 4
    backing = "| engine | 12,345 |\nsync 4.2 seconds\nMFU 41.5%\n"
    assert unbacked(doc, backing, tests="atol=3.3e-9") == []
    assert unbacked(doc, backing.replace("4.2 seconds", "4.2 GiB"), tests="atol=3.3e-9") == [
        "docs/x.md: '4.2 s' is in no table of docs/benchmarks.md, no file of benchmarks/results/ (nor a test)"]
    assert not is_backed("36-50 s", "took 136-50 s", "")         # a longer number does not back a shorter one
    assert not is_backed("2 s", "12 s and 2 GiB", "")            # a short figure needs its unit
    assert is_backed("36,248 tokens/s", "| Megatron | 0.452 s | 36,248 |", "")
    assert quoted_figures("HTTP 400s, TP 1 x DP 2, 2 x timeout") == []
