"""Start-up checks (miles.run.preflight, miles.utils.model_dir): every bad path, plugin or output is one line
naming the flag, the value and the fix, from --dry-run and from each place that loads a model directory."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.run import preflight as P
from miles.run.entry import dry_run
from miles.utils.errors import MilesError
from miles.utils.model_dir import ModelDirError, check_model_dir, load_tokenizer, num_params


def _data(tmp_path: Path) -> Path:
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(4)))
    return p


def _cfg(model: Path | str, data: Path, *extra: str):
    """A disaggregated plan with one engine (has engines: the reward is checked), 2 rollouts."""
    return parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
                       "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "2",
                       "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
                       "--output-dir", str(data.parent / "out"), "--dry-run", *extra])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _one_line_error(cfg) -> str:
    with pytest.raises((ConfigError, MilesError)) as e:
        dry_run(cfg)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------------- the model directory
def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def _garble_header(d: Path) -> None:
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:40] = b"\xff" * 32
    f.write_bytes(bytes(raw))


def _drop_config(d: Path) -> None:
    (d / "config.json").unlink()


def _drop_tokenizer(d: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()


def _missing_shard(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


BROKEN = [
    (_truncate, "model.safetensors is truncated"),
    (_garble_header, "model.safetensors has a corrupt safetensors header"),
    (_drop_config, "is not a HF model directory (no config.json)"),
    (_drop_tokenizer, "has no tokenizer"),
    (_missing_shard, "names 1 shard(s) that are missing, e.g. model-00002-of-00002.safetensors"),
]


@pytest.mark.parametrize("breaker,expected", BROKEN, ids=[b.__name__.strip("_") for b, _ in BROKEN])
def test_dry_run_names_a_broken_hf_checkpoint(tmp_path: Path, tiny_model_dir: Path, breaker, expected: str):
    model = _copy(tiny_model_dir, tmp_path / "model")
    breaker(model)
    msg = _one_line_error(_cfg(model, _data(tmp_path)))
    assert msg.startswith(f"--hf-checkpoint {model}") and expected in msg, msg


def test_dry_run_nonexistent_hf_checkpoint_is_not_a_hub_lookup(tmp_path: Path):
    missing = tmp_path / "no_such_model"
    msg = _one_line_error(_cfg(missing, _data(tmp_path)))
    assert msg.startswith(f"--hf-checkpoint {missing}: no such directory") and "not downloaded" in msg, msg
    assert "Repo id" not in msg


def test_every_loader_names_the_truncated_file(tmp_path: Path, tiny_model_dir: Path):
    """The trainer's model loading, the embedded engine's and the tokenizer's: one line naming the file."""
    from miles.engine.model_runner import ModelRunner, RunnerOptions
    from miles.trainer.modeling import load_hf_model

    model = _copy(tiny_model_dir, tmp_path / "model")
    _truncate(model)
    for load in (lambda: load_hf_model(model, torch.device("cpu"), flag="--ref-load"),
                 lambda: ModelRunner(model, RunnerOptions(device="cpu"))):
        with pytest.raises(ModelDirError, match=r"model\.safetensors is truncated: \d+ bytes, its header describes"):
            load()
    with pytest.raises(ModelDirError, match="^--ref-load "):
        load_hf_model(model, torch.device("cpu"), flag="--ref-load")
    missing = tmp_path / "missing"
    for load in (lambda: load_hf_model(missing, torch.device("cpu")),
                 lambda: ModelRunner(missing, RunnerOptions(device="cpu")),
                 lambda: load_tokenizer(missing)):
        with pytest.raises(ModelDirError, match="no such directory"):
            load()


def test_engine_process_with_a_truncated_model_exits_2_with_one_line(tmp_path: Path, tiny_model_dir: Path):
    model = _copy(tiny_model_dir, tmp_path / "model")
    _truncate(model)
    r = subprocess.run([sys.executable, "-m", "miles.engine", "--hf-checkpoint", str(model), "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "model.safetensors is truncated" in out and "Traceback" not in out, out


def test_good_model_dir_passes_and_counts_parameters(tiny_model_dir: Path):
    from safetensors.torch import load_file

    assert check_model_dir(tiny_model_dir, "--hf-checkpoint", tokenizer=True) == tiny_model_dir
    stored = load_file(str(tiny_model_dir / "model.safetensors"))
    assert num_params(tiny_model_dir) == sum(t.numel() for t in stored.values()) > 10_000


# ---------------------------------------------------------------------------- other paths
def test_every_bad_path_is_named_at_once(tmp_path: Path, tiny_model_dir: Path):
    data = _data(tmp_path)
    (tmp_path / "bad_ckpt").mkdir()
    (tmp_path / "bad_ckpt" / "latest_checkpointed_iteration.txt").write_text("7")  # Miles's tracker, no iter_0000007
    cfg = _cfg(tiny_model_dir, data, "--ref-load", str(tmp_path / "no_ref"), "--critic-load", str(data),
               "--load", str(tmp_path / "bad_ckpt"), "--eval-prompt-data", "ev", str(tmp_path / "no_eval.jsonl"),
               "--kl-coef", "0.1", "--advantage-estimator", "ppo", "--train-backend", "fsdp")  # FSDP's --load reader
    cfg.data.prompt_data = str(tmp_path / "no_train.jsonl")
    msg = _one_line_error(cfg)
    assert msg.startswith("5 problems found before starting"), msg
    for part in (f"--ref-load {tmp_path / 'no_ref'}: no such directory",
                 f"--critic-load {data} is a file, not a directory",
                 f"--load {tmp_path / 'bad_ckpt'}: latest_checkpointed_iteration.txt names iter_0000007, which is "
                 "missing",
                 f"--prompt-data {tmp_path / 'no_train.jsonl'}: no such file",
                 f"--eval-prompt-data ev {tmp_path / 'no_eval.jsonl'}: no such file"):
        assert part in msg, (part, msg)


def test_a_load_not_written_yet_is_a_fresh_start_as_in_miles(tmp_path: Path, tiny_model_dir: Path):
    """Miles's scripts pass ``--load $SAVE --save $SAVE`` on the first run too: an empty or missing --load passes."""
    from miles.run.preflight import preflight

    data = _data(tmp_path)
    (tmp_path / "empty").mkdir()
    for load in (tmp_path / "empty", tmp_path / "not_yet"):
        preflight(_cfg(tiny_model_dir, data, "--load", str(load), "--save", str(load)), has_engines=False)


# ---------------------------------------------------------------------------- plugins and rewards
PLUGINS = '''
async def rm_ok(args, sample):
    return 1.0

def rm_three(a, b, c):
    return 1.0

def gen_sync(args, sample, sampling_params):
    return sample

def filter_one(samples):
    return True

def loss_one(inputs):
    return inputs

NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch) -> str:
    (tmp_path / "pf_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("pf_plugins", None)
    return "pf_plugins"


@pytest.mark.parametrize("flags,expected", [
    (["--rm-type", "nope"], "--rm-type 'nope' is not a known reward"),
    (["--custom-rm-path", "no_such_module_xyz.fn"], "--custom-rm-path 'no_such_module_xyz.fn': cannot import"),
    (["--custom-rm-path", "{m}.rm_three"], "--custom-rm-path '{m}.rm_three' has signature (a, b, c)"),
    (["--custom-rm-path", "{m}.NOT_CALLABLE"], "names a int, not a function"),
    (["--custom-generate-function-path", "{m}.gen_sync"], "must be a coroutine function"),
    (["--dynamic-sampling-filter-path", "{m}.filter_one"], "--dynamic-sampling-filter-path '{m}.filter_one' has "
                                                           "signature (samples)"),
    (["--loss-type", "custom_loss", "--custom-loss-function-path", "{m}.loss_one"],
     "--custom-loss-function-path '{m}.loss_one' has signature (inputs)"),
    (["--custom-loss-function-path", "{m}.missing_fn"], "has no attribute 'missing_fn'"),
], ids=["rm-type", "rm-import", "rm-arity", "rm-not-callable", "generate-sync", "filter-arity", "loss-arity",
        "loss-missing"])
def test_dry_run_checks_plugins(tmp_path: Path, tiny_model_dir: Path, plugin_module: str, flags, expected):
    flags = [f.format(m=plugin_module) for f in flags]
    cfg = _cfg(tiny_model_dir, _data(tmp_path), *flags)
    if "--rm-type" not in flags and "--custom-rm-path" in flags:
        cfg.reward.rm_type = None
    msg = _one_line_error(cfg)
    assert expected.format(m=plugin_module) in msg, msg


def test_generic_miles_plugin_flag_must_import(tmp_path: Path, tiny_model_dir: Path):
    """A plugin flag without a known calling convention here is still imported and must be callable."""
    cfg = _cfg(tiny_model_dir, _data(tmp_path))
    sections = [getattr(cfg, f.name) for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]
    generic = [(s, n) for n in P.PLUGIN_FIELDS[4:] for s in sections if hasattr(s, n)]
    if not generic:
        pytest.skip("no generic plugin flag is parsed by this build")
    section, name = generic[0]
    setattr(section, name, "no_such_module_xyz.fn")
    msg = _one_line_error(cfg)
    assert f"{P._flag(name)} 'no_such_module_xyz.fn': cannot import" in msg, msg


def test_reward_is_only_required_when_engines_run(tmp_path: Path, tiny_model_dir: Path):
    data = _data(tmp_path)
    cfg = _cfg(tiny_model_dir, data)
    cfg.reward.rm_type = None
    assert "no reward chosen" in _one_line_error(cfg)
    P.preflight(cfg, has_engines=False)  # SFT / --debug-train-only: no rollout manager, no reward


def test_a_passing_dry_run_starts_the_same_checks(tmp_path: Path, tiny_model_dir: Path, plugin_module: str):
    cfg = _cfg(tiny_model_dir, _data(tmp_path), "--custom-rm-path", f"{plugin_module}.rm_ok")
    cfg.reward.rm_type = None
    text = dry_run(cfg)
    assert '"num_rollout": 2' in text
    from miles.rollout.rewards import Rewarder

    assert Rewarder(cfg.reward).custom is not None  # what the run builds accepts it too


# ---------------------------------------------------------------------------- backend hook
def test_backend_check_runs_with_the_checkpoint_config(tmp_path: Path, tiny_model_dir: Path, monkeypatch):
    monkeypatch.setattr(P, "_BACKEND_CHECKS", {})
    seen = []

    def check(cfg, hf_config):
        seen.append(hf_config["model_type"])
        raise ConfigError(f"--num-layers 3 does not match config.json num_hidden_layers "
                          f"{hf_config['num_hidden_layers']}")

    P.register_backend_check("megatron", check)  # the default backend
    P.register_backend_check("megatron", check)  # once only
    P.register_backend_check("fsdp", "no_such_module_xyz.check")  # lazy: never imported for megatron
    msg = _one_line_error(_cfg(tiny_model_dir, _data(tmp_path)))
    assert seen == ["qwen3"] and msg == "--num-layers 3 does not match config.json num_hidden_layers 2"


def test_backend_check_by_dotted_path(tmp_path: Path, tiny_model_dir: Path, plugin_module: str, monkeypatch):
    (tmp_path / "pf_backend.py").write_text("from miles.config import ConfigError\n"
                                            "def check(cfg, hf):\n    raise ConfigError('backend says no')\n")
    monkeypatch.setattr(P, "_BACKEND_CHECKS", {})
    P.register_backend_check("fsdp", "pf_backend.check")
    assert _one_line_error(_cfg(tiny_model_dir, _data(tmp_path), "--train-backend", "fsdp")) == "backend says no"


# ---------------------------------------------------------------------------- --save
def _mount_tmpfs(path: Path, size: str, ro: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=False)


def test_read_only_save_is_refused_before_start(tmp_path: Path, tiny_model_dir: Path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "1M", ro=True)
    try:
        for save in (mnt, mnt / "run1" / "ckpt"):  # the directory, or its nearest existing parent
            msg = _one_line_error(_cfg(tiny_model_dir, _data(tmp_path), "--save", str(save)))
            assert msg.startswith(f"--save {save}: cannot write there") and "Read-only file system" in msg, msg
    finally:
        _umount(mnt)


def test_save_without_room_for_one_checkpoint_is_refused(tmp_path: Path, tiny_model_dir: Path):
    """The tiny model's checkpoint (weights + Adam, fp32) is about 1.3 MB: a 1 MB tmpfs is refused, 2 MB is not."""
    small, big = tmp_path / "small", tmp_path / "big"
    _mount_tmpfs(small, "1M")
    try:
        _mount_tmpfs(big, "2M")
        try:
            msg = _one_line_error(_cfg(tiny_model_dir, _data(tmp_path), "--save", str(small / "ckpt")))
            assert msg.startswith(f"--save {small / 'ckpt'}: one checkpoint needs about 1.") and " free" in msg, msg
            dry_run(_cfg(tiny_model_dir, _data(tmp_path), "--save", str(big / "ckpt")))
            dry_run(_cfg(tiny_model_dir, _data(tmp_path), "--save", str(small / "ckpt"), "--no-save-optim"))
            assert not (big / "ckpt").exists() and list(big.iterdir()) == []  # the probe leaves nothing
        finally:
            _umount(big)
    finally:
        _umount(small)


def test_checkpoint_estimate_is_within_the_real_size(tmp_path: Path, tiny_model_dir: Path, one_rank_group):
    """The estimate is the fp32 weights + 2 Adam moments: 0.7-1.0x what a real FSDP checkpoint takes."""
    from trainer_harness import build_from_config, flags, parse

    save = tmp_path / "ckpt"
    cfg = parse(tiny_model_dir, flags("fsdp", ["--save", str(save)]))
    build_from_config(cfg, group=one_rank_group).checkpoint(0, extra={})
    real = sum(f.stat().st_size for f in save.rglob("*") if f.is_file())
    assert 0.7 * real <= P.checkpoint_bytes(cfg) <= real, (P.checkpoint_bytes(cfg), real)
