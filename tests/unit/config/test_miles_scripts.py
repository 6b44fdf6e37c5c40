"""Miles v0.1.0's own launch flag lists (tests/fixtures/miles_scripts/*.flags) run unchanged.

Each fixture says what it expects in its ``# expect:`` line: ``dry-run`` (parsing, validation and
``--dry-run``'s plan pass, with the placeholders replaced by a tiny local model, data file and output
directory) or ``refused: --flag`` (one ConfigError line whose first word is that flag, never argparse's
usage dump). ``# entry:`` picks train.py or train_async.py.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args

FIXTURES = sorted((Path(__file__).resolve().parents[2] / "fixtures" / "miles_scripts").glob("*.flags"))
REPO = Path(__file__).resolve().parents[3]


def read_fixture(path: Path) -> tuple[str, str, list[str]]:
    """(entry, expect, flag lines) of a fixture."""
    entry = expect = ""
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("# entry:"):
            entry = line.split(":", 1)[1].strip()
        elif line.startswith("# expect:"):
            expect = line.split(":", 1)[1].strip()
        elif line.startswith("--"):
            lines.append(line)
    return entry, expect, lines


def fixture_argv(lines: list[str], subs: dict[str, str]) -> list[str]:
    """One flag per line; a value starting with { or [ is one JSON token, others split as the shell does."""
    argv: list[str] = []
    for line in lines:
        name, _, rest = line.partition(" ")
        for key, value in subs.items():
            rest = rest.replace("{" + key + "}", value)
        argv.append(name)
        if rest:
            argv += [rest] if rest[:1] in "{[" else shlex.split(rest)
    return argv


@pytest.fixture(scope="module")
def subs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("miles_scripts")
    data = out / "data.jsonl"
    row = {"prompt": "1+1=", "label": "2", "reward_model": "2", "index": 0,
           "messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    data.write_text(json.dumps(row) + "\n")
    # the keys of Miles's examples/infra_features/train_infer_mismatch_helper/mis.yaml that name flags here
    (out / "mis.yaml").write_text("use_tis: true\ntis_mode: truncate\ntis_upper_bound: 2.0\n")
    return {"MODEL": str(tiny_model_dir), "DATA": str(data), "OUT": str(out)}


def test_every_fixture_says_what_it_expects():
    assert len(FIXTURES) == 18
    for path in FIXTURES:
        entry, expect, lines = read_fixture(path)
        assert entry in ("train.py", "train_async.py"), path.name
        assert expect == "dry-run" or expect.startswith("refused: --"), f"{path.name}: # expect: {expect}"
        assert lines, path.name


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_miles_launch_flags(path: Path, subs: dict[str, str]):
    from miles.run.entry import dry_run

    entry, expect, lines = read_fixture(path)
    argv = fixture_argv(lines, subs) + ["--dry-run"]
    if expect == "dry-run":
        cfg = parse_args(argv, is_async=entry == "train_async.py")
        assert "role plan" in dry_run(cfg)
        return
    flag = expect.removeprefix("refused: ")
    with pytest.raises(ConfigError) as ei:
        cfg = parse_args(argv, is_async=entry == "train_async.py")
        dry_run(cfg)
    msg = str(ei.value)
    assert "\n" not in msg and "usage:" not in msg
    assert msg.split(" ", 1)[0].rstrip(":") == flag, msg


@pytest.mark.parametrize("name", ["fsdp_qwen3_0_6b", "lora_qwen2_5_0_5b"])
def test_entrypoint_prints_one_line_or_the_plan(name: str, subs: dict[str, str]):
    """Through train.py itself: a refusal is one stderr line and exit 2; a dry run prints the plan."""
    entry, expect, lines = read_fixture(next(p for p in FIXTURES if p.stem == name))
    r = subprocess.run([sys.executable, entry, *fixture_argv(lines, subs), "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    if expect == "dry-run":
        assert r.returncode == 0, r.stderr[-2000:]
        assert "role plan" in r.stdout
    else:
        errors = [ln for ln in r.stderr.splitlines() if expect.removeprefix("refused: ") in ln]
        assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
        assert "usage:" not in r.stderr and "Traceback" not in r.stderr
