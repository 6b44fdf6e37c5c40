"""Miles v0.1.0's recorded training commands run, not only parse: each fixture of tests/fixtures/miles_scripts/ that
passes --dry-run is replayed for 2 rollouts under real torchrun on CPU at tiny scale (tests/miles_fixtures.py's
``tiny_replay``: model-shape flags to a tiny model of the same family, GPU counts and parallel sizes to a CPU world of
at most 4 ranks, batch and length sizes to tiny values, data and --save to local files, the OPD teacher servers to
embedded engines (``teacher_stand_ins``), the formal-math reward's Lean server to ``lean_stand_in``, every other flag
as recorded) with --check-weight-update-equal after every weight sync. A LoRA command's replay checks that its
adapters train: its reward varies within a group (``varying_reward``; the recorded math reward is 0 on every sample of
a random tiny policy), ``train/grad_norm`` is > 0 in every step and a saved ``lora_B`` moved off its zero init.
The fixtures refused here only by SGLang-only serving flags that ``SGLANG_ONLY_REFUSED`` names run the same way (the
replay drops those flags).
docs/miles-scripts.md lists the result per command.

``make test`` runs SUBSET (one FSDP, one Megatron TP, one p2p command); ``make test-replay`` (MILES_REPLAY_ALL=1) runs
every fixture. A replay that fails today is marked ``xfail(strict=True)`` with the defect: it fails the tier once the
defect is fixed, until the mark goes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from _miles_e2e import run, tail
from miles_fixtures import (
    FIXTURES,
    PLUGIN_FOLDERS,
    Replay,
    lean_stand_in,
    read_fixture,
    skills_stand_in,
    teacher_stand_ins,
    tiny_replay,
)

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.replay, pytest.mark.timeout(900)]

SUBSET = ("fsdp_qwen3_0_6b", "megatron_qwen3_dense", "p2p_qwen3_4b")
RUN_ALL = os.environ.get("MILES_REPLAY_ALL") == "1"
# fixture -> the defect its replay hits today (docs/miles-scripts.md gives the error line and the cause)
KNOWN_FAILURES: dict[str, str] = {}
# fixtures refused on a machine without SGLang only by SGLang-only serving flags, which the replay drops (its engines
# are embedded ones): replayed too (the LoRA commands' SGLang LoRA flags are the embedded engine's too now)
SGLANG_ONLY_REFUSED = ("megatron_deepseek_v32",)
REPLAYED = [p for p in FIXTURES if read_fixture(p)[1] == "dry-run" or p.stem in SGLANG_ONLY_REFUSED]


def _param(path: Path):
    marks = []
    if not RUN_ALL and path.stem not in SUBSET:
        marks.append(pytest.mark.skip(reason="the whole replay tier runs under `make test-replay` (MILES_REPLAY_ALL=1)"))
    if path.stem in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[path.stem]))
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replay_models")


@pytest.fixture(scope="session")
def skills_url():
    with skills_stand_in() as url:
        yield url


@pytest.fixture(scope="session")
def lean_url():
    with lean_stand_in() as url:
        yield url


@pytest.mark.parametrize("path", [_param(p) for p in REPLAYED])
def test_recorded_command_runs_two_rollouts(path: Path, tiny_models: Path, skills_url: str, lean_url: str,
                                            tmp_path: Path) -> None:
    replay = tiny_replay(path, tmp_path, tiny_models, skills_url)
    log = tmp_path / f"{replay.name}.log"
    here = Path(__file__).resolve()     # the repo, tests/ (miles_fixtures.varying_reward) and Miles's plugin folders
    pythonpath = os.pathsep.join([str(here.parents[2]), str(here.parents[1]), *map(str, PLUGIN_FOLDERS)])
    with teacher_stand_ins(replay, path, tiny_models, tmp_path):   # the OPD teacher servers Miles's scripts start before train.py
        cmd = ["torchrun", "--standalone", "--nproc-per-node", str(replay.nproc), replay.entry, *replay.argv]
        t0 = time.monotonic()
        result = run(cmd, log, timeout=600, PYTHONPATH=pythonpath, LEAN_SERVER_URL=lean_url)
        seconds = time.monotonic() - t0
    scaled = "\n".join(f"  {flag}: {change}" for flag, change in replay.changed.items())
    assert result.returncode == 0, f"{replay.name} exit code {result.returncode} after {seconds:.0f}s; scaled flags:\n" \
                                   f"{scaled}\nlog {log}:\n{tail(log)}"
    out = Path(replay.argv[replay.argv.index("--output-dir") + 1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["rollout_id"] for r in records] == [0, 1], records
    if "--rm-url" in replay.changed or "--opd-teacher-urls" in replay.changed:   # the teacher stand-in answered,
        kl = [r["train/opd_reverse_kl_mean"] for r in records]                   # and it is another model
        assert all(abs(v) > 1e-4 for v in kl), records
    if replay.engines:  # the first sync and one after each rollout's training step, every tensor equal
        checks = log.read_text().count("--check-weight-update-equal: ")
        assert checks >= 3, f"{checks} weight checks; log {log}:\n{tail(log)}"
    if "--lora-rank" in replay.argv:
        check_adapters_trained(replay, records, log)
    if "--sglang-enable-lora" in replay.argv and "--lora-rank" in replay.argv:   # adapter sync: every sync loads it
        syncs = [line for line in log.read_text().splitlines() if "weight sync v" in line]
        assert len(syncs) >= 3 and all("LoRA adapter miles_lora" in line for line in syncs), tail(log)
    elif "--lora-base-cpu-backup" in replay.argv:   # the syncs after the first sent the merged LoRA targets only
        assert "trained tensors only: --lora-base-cpu-backup" in log.read_text(), tail(log)


def check_adapters_trained(replay: Replay, records: list[dict], log: Path) -> None:
    """A LoRA replay trained its adapters: a nonzero gradient in every step (its reward varies within a group:
    tiny_replay) and the saved adapters' ``lora_B`` (zero-initialised) moved off zero on some rank."""
    norms = [r.get("train/grad_norm") for r in records]
    assert all(isinstance(v, float | int) and v > 0 for v in norms), \
        f"{replay.name}: train/grad_norm {norms}: the adapters got no gradient; log {log}:\n{tail(log)}"
    save = Path(replay.argv[replay.argv.index("--save") + 1])
    files = sorted(save.glob("**/lora/rank_*.pt"))
    assert files, f"{replay.name}: no adapter files (lora/rank_*.pt) under --save {save}"
    newest = max(files, key=lambda f: f.stat().st_mtime_ns).parent.parent
    moved = []
    for f in sorted(newest.glob("lora/rank_*.pt")):
        adapters = torch.load(f, map_location="cpu", weights_only=False)["adapters"]
        moved += [float(t.abs().max()) for k, t in adapters.items() if "lora_B" in k and t.numel()]
    assert moved and max(moved) > 0, f"{replay.name}: every lora_B in {newest} is still 0 (its init): the " \
                                     f"optimizer did not move the adapters; log {log}:\n{tail(log)}"
