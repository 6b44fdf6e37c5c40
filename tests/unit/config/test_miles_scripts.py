"""Miles v0.1.0's own launch flag lists (tests/fixtures/miles_scripts/*.flags) run unchanged.

Each fixture says what it expects in its ``# expect:`` line: ``dry-run`` (parsing, validation and
``--dry-run``'s plan pass, with the placeholders replaced by a local model directory, data file and output
directory) or ``refused: --flag`` (one ConfigError line whose first word is that flag, never argparse's
usage dump). ``# entry:`` picks train.py or train_async.py. ``# model: NAME`` gives ``{MODEL}`` the shape
of the model the script trains: models/NAME.json is that model's config.json, and the directory built
from it (``miles.utils.sparse_model``) has the real checkpoint's safetensors headers over sparse files, so
the dry run checks the script's Megatron shape flags, the headers and the --save room against the real
sizes without a byte of weights written. Without ``# model:`` it is the tiny test model.

``--save`` room: the dry run refuses a --save filesystem without room for one checkpoint (fp32 weights and
two Adam moments: 12 bytes a parameter, 48 GB for Qwen3-4B, 366 GB for Qwen3-30B-A3B). So that every
``dry-run`` fixture runs the whole check (data, plan, --save), {OUT} is a tmpfs mounted with room for the
largest (a size limit: nothing is written but the small data files); where no tmpfs can be mounted (not
root), MILES_FIXTURE_OUT may name a filesystem with that much free, else the fixtures skip saying so. A
fixture whose --save has no room fails: the refusal is tested on its own in tests/unit/run/test_preflight.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from miles_fixtures import (
    FIXTURES,
    HERE,
    MODELS,
    PLUGIN_FOLDERS,
    eval_delegate_yaml,
    fixture_argv,
    fixture_data,
    fixture_model,
    multi_task_yaml,
    read_fixture,
    recorded_teachers,
    without_absent_kernel_flags,
    write_workdir,
)

from miles.config import ConfigError, parse_args

REPO = Path(__file__).resolve().parents[3]
CHECKPOINT_BYTES_PER_PARAM = 4 * 3  # fp32 weights + two fp32 Adam moments (no fixture has --no-save-optim or PPO)


ROOM = "16T"  # the tmpfs's size limit (nothing is written): one checkpoint of the largest fixture model (GLM-5) is 8.9 TB


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """{OUT}: a tmpfs with room for any fixture's --save (or MILES_FIXTURE_OUT), with the data files."""
    root = os.environ.get("MILES_FIXTURE_OUT")
    mounted = None
    if root:
        out = Path(root)
        out.mkdir(parents=True, exist_ok=True)
    else:
        out = mounted = tmp_path_factory.mktemp("miles_scripts")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={ROOM}", "tmpfs", str(out)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs with room for --save here (needs root / CAP_SYS_ADMIN: "
                        f"{r.stderr.strip()}); set MILES_FIXTURE_OUT to a filesystem with 400 GB free")
    try:
        yield write_workdir(out)
    finally:
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=False)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    """name -> model directory (built once per module; None -> the tiny model)."""
    from miles.utils.sparse_model import build_sparse_model

    root = tmp_path_factory.mktemp("sparse_models")
    built: dict[str | None, Path] = {None: tiny_model_dir}

    def get(name: str | None) -> Path:
        if name not in built:
            built[name] = build_sparse_model(root / name, json.loads((MODELS / f"{name}.json").read_text()))
        return built[name]

    return get


@pytest.fixture
def plugins_on_path(monkeypatch):
    """The folders Miles's scripts run from (Miles's root, search-r1/, tau-bench/) on sys.path."""
    for folder in PLUGIN_FOLDERS:
        monkeypatch.syspath_prepend(str(folder))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in ("generate_with_search", "generate_with_tau", "examples")]:
        sys.modules.pop(name)


def subs_for(path: Path, workdir: Path, model_dirs) -> dict[str, str]:
    return {"MODEL": str(model_dirs(fixture_model(path))), "DATA": str(workdir / fixture_data(path)), "OUT": str(workdir)}


def save_shortfall(cfg, model: Path) -> int | None:
    """The bytes one --save checkpoint of ``model`` needs when --save's filesystem has less free; else None."""
    from miles.utils.sparse_model import checkpoint_tensors

    if not cfg.checkpoint.save:
        return None
    params = sum(math.prod(s) for s in checkpoint_tensors(json.loads((model / "config.json").read_text())).values())
    need = params * CHECKPOINT_BYTES_PER_PARAM
    target = Path(cfg.checkpoint.save)
    while not target.exists():
        target = target.parent
    return need if shutil.disk_usage(target).free < need else None


def test_every_fixture_says_what_it_expects():
    assert len(FIXTURES) == 67
    for path in FIXTURES:
        entry, expect, lines = read_fixture(path)
        assert entry in ("train.py", "train_async.py"), path.name
        assert expect == "dry-run" or expect.startswith("refused: --"), f"{path.name}: # expect: {expect}"
        assert lines, path.name
        model = fixture_model(path)
        assert model is None or (MODELS / f"{model}.json").is_file(), f"{path.name}: # model: {model}"


def test_the_opd_teacher_servers_the_replay_stands_in_for():
    """The replay (tests/e2e/test_miles_replay.py) starts an embedded engine per teacher address these name; every
    other fixture names none, so none starts for it."""
    subs = {"MODEL": "m", "DATA": "d", "OUT": "o"}
    teachers = {p.stem: recorded_teachers(fixture_argv(read_fixture(p)[2], subs)) for p in FIXTURES}
    assert {k: v for k, v in teachers.items() if v} == {
        "opd_sglang_qwen3_8b": ["http://127.0.0.1:13141"],
        "opd_multi_teacher_qwen3_8b": ["http://127.0.0.1:13141", "http://127.0.0.1:13142"]}


def test_replay_keep_moves_its_parallel_size_last(tmp_path: Path):
    """The replay halves CP, then PP, then TP while its trainer ranks pass the CPU world's budget; a fixture's
    ``# replay-keep: FLAG`` moves that size last: DeepSeek-V3.2's disaggregated replay keeps PP 2 (DSA under PP) on
    its 2 trainer ranks, where a fixture without the header keeps TP; a header naming no parallel size is refused."""
    from miles_fixtures import HALVING_ORDER, halving_order, tiny_replay

    v32 = HERE / "megatron_deepseek_v32.flags"
    assert halving_order(HERE / "megatron_qwen3_dense.flags") == HALVING_ORDER
    assert halving_order(v32)[-1] == "--pipeline-model-parallel-size"
    assert [p.stem for p in FIXTURES if halving_order(p) != HALVING_ORDER] == ["megatron_deepseek_v32"]
    argv = tiny_replay(v32, tmp_path / "work", tmp_path / "models").argv
    assert [argv[argv.index(f) + 1] for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                              "--actor-num-gpus-per-node")] == ["1", "2", "2"]
    bad = tmp_path / "bad.flags"
    bad.write_text("# replay-keep: --num-layers\n--num-layers 2\n")
    with pytest.raises(ValueError, match="bad.flags: # replay-keep: '--num-layers' is none of --context-parallel-size"):
        halving_order(bad)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_miles_launch_flags(path: Path, workdir: Path, model_dirs, plugins_on_path):
    from miles.run.entry import dry_run

    entry, expect, lines = read_fixture(path)
    argv = without_absent_kernel_flags(fixture_argv(lines, subs_for(path, workdir, model_dirs))) + ["--dry-run"]
    if expect == "dry-run":
        cfg = parse_args(argv, is_async=entry == "train_async.py")
        need = save_shortfall(cfg, model_dirs(fixture_model(path)))
        assert need is None, f"{{OUT}} ({workdir}) has no room for one --save checkpoint ({need / 1e9:.0f} GB)"
        assert "role plan" in dry_run(cfg)
        return
    flag = expect.removeprefix("refused: ")
    with pytest.raises(ConfigError) as ei:
        cfg = parse_args(argv, is_async=entry == "train_async.py")
        dry_run(cfg)
    msg = str(ei.value)
    assert "\n" not in msg and "usage:" not in msg
    found = [p for p in problems(msg) if not p.startswith("--save ")] or [msg]  # this machine's disk aside (above)
    assert found[0].split(" ", 1)[0].rstrip(":") == flag, msg


KERNELED = [p for p in FIXTURES if read_fixture(p)[1] == "dry-run"
            and without_absent_kernel_flags(fixture_argv(read_fixture(p)[2], {})) != fixture_argv(read_fixture(p)[2], {})]


@pytest.mark.parametrize("path", KERNELED, ids=[p.stem for p in KERNELED])
def test_kernel_flags_refused_here(path: Path, workdir: Path, model_dirs, plugins_on_path):
    """A fixture passing a flag whose GPU kernel package does not import here (--moe-grouped-gemm without
    transformer-engine, ...) is refused on that flag as recorded: test_miles_launch_flags drops it (above)."""
    from miles.run.entry import dry_run

    entry, _, lines = read_fixture(path)
    argv = fixture_argv(lines, subs_for(path, workdir, model_dirs)) + ["--dry-run"]
    changed: dict[str, str] = {}
    without_absent_kernel_flags(argv, changed)
    with pytest.raises(ConfigError) as ei:
        dry_run(parse_args(argv, is_async=entry == "train_async.py"))
    found = [p for p in problems(str(ei.value)) if not p.startswith("--save ")]
    assert found and found[0].split(" ", 1)[0] in changed and " needs " in found[0], ei.value


SHAPED = [p for p in FIXTURES if fixture_model(p) and any(ln.startswith("--num-layers ") for ln in read_fixture(p)[2])]


SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
               "--kv-channels", "--rotary-base", "--untie-embeddings-and-output-weights", "--add-qkv-bias",
               "--qk-layernorm", "--vocab-size", "--norm-epsilon", "--num-experts")


def problems(msg: str) -> list[str]:
    """The lines of one ConfigError: itself, or each numbered problem of 'N problems found before starting'."""
    if " problems found before starting: (1) " not in msg:
        return [msg]
    return [p.strip() for p in re.split(r"\(\d+\) ", msg.split(": ", 1)[1]) if p.strip()]


@pytest.mark.parametrize("path", SHAPED, ids=[p.stem for p in SHAPED])
def test_shape_flags_are_checked_against_the_model(path: Path, workdir: Path, model_dirs, plugins_on_path):
    """The same flags on a model of another shape (Qwen3-0.6B) are refused on a shape flag, naming the flag's
    value and config.json's: the dry run reads the shapes, it does not pass them by name."""
    from miles.run.entry import dry_run

    entry, expect, lines = read_fixture(path)
    subs = subs_for(path, workdir, model_dirs) | {"MODEL": str(model_dirs("Qwen3-0.6B"))}
    argv = without_absent_kernel_flags(fixture_argv(lines, subs)) + ["--dry-run", "--train-backend", "megatron"]
    with pytest.raises(ConfigError) as ei:
        dry_run(parse_args(argv, is_async=entry == "train_async.py"))
    found = [p for p in problems(str(ei.value)) if p.split(" ", 1)[0] in SHAPE_FLAGS]
    if expect.startswith("refused: ") and not found:  # refused before the model is read (LoRA, multimodal, ...)
        assert problems(str(ei.value))[0].split(" ", 1)[0].rstrip(":") == expect.removeprefix("refused: ")
        return
    assert found, ei.value
    assert any(m in found[0] for m in ("does not match --hf-checkpoint's config.json", "is missing but",
                                       "describes a dense model")), ei.value


def test_sparse_model_headers_are_checked(model_dirs, tmp_path: Path):
    """The sparse checkpoint is what the preflight sees of a real one: full-size files of no blocks, whose
    headers give the real parameter count; a shard cut by one byte is named."""
    from miles.utils.model_dir import ModelDirError, check_model_dir, num_params

    model = model_dirs("Qwen3-4B")
    shards = sorted(model.glob("*.safetensors"))
    assert len(shards) == 2 and sum(f.stat().st_size for f in shards) > 8 * 10**9
    assert sum(f.stat().st_blocks for f in shards) * 512 < 10 * 2**20  # sparse: nothing written
    assert num_params(model) == 4_022_468_096  # Qwen3-4B: 4.0B (tied embeddings)
    from miles.utils.sparse_model import build_sparse_model

    cut = build_sparse_model(tmp_path / "cut", json.loads((MODELS / "Qwen3-4B.json").read_text()))
    with open(cut / shards[-1].name, "r+b") as f:
        f.truncate(shards[-1].stat().st_size - 1)
    with pytest.raises(ModelDirError, match=f"{shards[-1].name} is truncated"):
        check_model_dir(cut, "--hf-checkpoint")


@pytest.mark.parametrize("name, yaml, make", [
    ("eval_delegate_qwen3_4b", "eval_delegate_multi_tasks.yaml", eval_delegate_yaml),
    ("eval_multi_task_qwen3_4b", "multi_task.yaml", multi_task_yaml)])
def test_eval_config_ifbench_needs_its_library(name: str, yaml: str, make, workdir: Path, model_dirs, plugins_on_path):
    """Miles's whole eval document (multi_tasks.yaml of the eval delegate scripts, multi_task.yaml of eval_multi_task,
    with their ifbench dataset): without IFBench's evaluation_lib the dry run is one line naming the dataset, its
    rm_type and where to get the library."""
    import importlib.util

    from miles.run.entry import dry_run

    if importlib.util.find_spec("evaluation_lib") is not None:
        pytest.skip("IFBench's evaluation_lib is importable here")
    path = HERE / f"{name}.flags"
    (workdir / f"full_{yaml}").write_text(make(workdir / "data.jsonl"))
    lines = [ln.replace(yaml, f"full_{yaml}") for ln in read_fixture(path)[2]]
    cfg = parse_args(fixture_argv(lines, subs_for(path, workdir, model_dirs)) + ["--dry-run"])
    with pytest.raises(ConfigError) as ei:
        dry_run(cfg)
    found = [p for p in problems(str(ei.value)) if p.startswith("--eval-config dataset 'ifbench'")]
    assert found and "rm_type 'ifbench'" in found[0] and "evaluation_lib" in found[0], ei.value


@pytest.mark.parametrize("name", ["fsdp_qwen3_0_6b", "megatron_qwen3_dense"])
def test_entrypoint_prints_one_line_or_the_plan(name: str, workdir: Path, model_dirs):
    """Through train.py itself: a refusal is one stderr line and exit 2; a dry run prints the plan."""
    path = next(p for p in FIXTURES if p.stem == name)
    entry, expect, lines = read_fixture(path)
    r = subprocess.run([sys.executable, entry, *fixture_argv(lines, subs_for(path, workdir, model_dirs)),
                        "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=300)
    if expect == "dry-run":
        assert r.returncode == 0, r.stderr[-2000:]
        assert "role plan" in r.stdout
    else:
        errors = [ln for ln in r.stderr.splitlines() if expect.removeprefix("refused: ") in ln]
        assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
        assert "usage:" not in r.stderr and "Traceback" not in r.stderr


def test_geo3k_grpo_prompts_hold_the_image_tokens(workdir: Path, model_dirs, plugins_on_path):
    """The GRPO fixture's prompts as its dry run loads them: Qwen3-VL-8B's image token (config.json's id) repeated to
    the image's merged-patch count of the checkpoint's image processor, between the vision start and end tokens."""
    from miles.rollout.multimodal import MEDIA_KEY, image_inputs
    from miles.rollout.rollout_fn import build_prompt_dataset
    from miles.utils.model_dir import load_tokenizer

    path = HERE / "grpo_geo3k_vlm.flags"
    cfg = parse_args(fixture_argv(read_fixture(path)[2], subs_for(path, workdir, model_dirs)) + ["--dry-run"])
    model = str(model_dirs(fixture_model(path)))
    config = json.loads((Path(model) / "config.json").read_text())
    item = build_prompt_dataset(cfg.data, load_tokenizer(model, "--hf-checkpoint"))[0]
    images = image_inputs(model)
    (n,) = images.tokens_per_image(images.pixels(item.metadata[MEDIA_KEY]["images"])["image_grid_thw"])
    start = item.prompt_ids.index(config["vision_start_token_id"])
    assert n > 1 and item.prompt_ids[start + 1:start + n + 2] == [config["image_token_id"]] * n + [
        config["vision_end_token_id"]]
    assert item.prompt_ids.count(config["image_token_id"]) == n and item.label == "0"


def test_deepseek_v4_command_without_fp8_training(workdir: Path, model_dirs, plugins_on_path):
    """The recorded DeepSeek-V4 command (``megatron_deepseek_v4``, refused on ``--fp8-format``: FP8 training is not
    built) without its three FP8 training flags: every flag of Miles's Megatron fork and every model check passes
    against V4-Flash's 4-layer config.json (the sparse checkpoint's headers too); what is left refused here is the
    engine's: the SGLang-only serving flags (the embedded engine, which ``--rollout-engine auto`` picks on this
    machine, serves no EP); without those the dry run passes, ``--use-rollout-routing-replay`` included (the
    embedded engine records V4's routing, the trainer replays it)."""
    import importlib.util

    from miles_fixtures import _drop, _drop_sglang_only

    from miles.run.entry import dry_run

    path = HERE / "megatron_deepseek_v4.flags"
    argv = without_absent_kernel_flags(fixture_argv(read_fixture(path)[2], subs_for(path, workdir, model_dirs)))
    for flag in ("--fp8-format", "--fp8-recipe", "--te-precision-config-file"):
        argv = _drop(argv, flag)
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ConfigError) as ei:
            dry_run(parse_args(argv + ["--dry-run"]))
        assert problems(str(ei.value))[0].startswith("--sglang-"), ei.value
        argv = _drop_sglang_only(argv, {}, "train.py")
    assert "--use-rollout-routing-replay" in argv
    assert "role plan" in dry_run(parse_args(argv + ["--dry-run"]))


def test_kimi_k25_command_without_its_sglang_serving_flags(workdir: Path, model_dirs, plugins_on_path):
    """The recorded Kimi-K2.5 command (``megatron_kimi_k25``, TP 8 + SP, EP 8, the distributed optimizer with
    ``--optimizer-cpu-offload`` at its one data-parallel rank) is refused on this machine only by its SGLang-only
    serving flags (``--sglang-ep-size``: the embedded engine, which ``--rollout-engine auto`` picks without SGLang,
    has no such setting); without them the dry run passes, ``--use-distributed-optimizer`` with expert parallelism
    included."""
    import importlib.util

    from miles_fixtures import _drop_sglang_only

    from miles.run.entry import dry_run

    path = HERE / "megatron_kimi_k25.flags"
    argv = without_absent_kernel_flags(fixture_argv(read_fixture(path)[2], subs_for(path, workdir, model_dirs)))
    assert "--use-distributed-optimizer" in argv and "--expert-model-parallel-size" in argv
    if importlib.util.find_spec("sglang") is None:
        changed: dict[str, str] = {}
        argv = _drop_sglang_only(argv, changed, "train.py")
        assert sorted(changed) == ["--sglang-ep-size"], changed
    assert "role plan" in dry_run(parse_args(argv + ["--dry-run"]))


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` less each of ``flags`` and its value."""
    out = list(argv)
    for flag in flags:
        i = out.index(flag)
        del out[i:i + 1 + (i + 1 < len(out) and not out[i + 1].startswith("--"))]
    return out


def test_inkling_command_keeps_its_disk_offload_flags(workdir: Path, model_dirs, plugins_on_path):
    """The recorded Inkling command (``megatron_inkling``, 4-layer config.json; Miles's ``--custom-model-provider-path
    miles_plugins.models.inkling.model.inkling_model_provider``: here the Inkling family's own build) with its
    ``--offload-train-target disk --offload-train-disk-dir`` kept. What must go: its 16-GPU engines (the recorded
    multi-node rollout rendered on one colocated 4-GPU node: they cannot divide its 4 rollout GPUs, the fixture's
    ``# expect:`` refusal) and its ``--load`` (Miles's torch_dist conversion of the checkpoint; the fixture gives the
    HF dir, refused by name without ``--megatron-to-hf-mode bridge``). The disk dir is pointed at {OUT} (the
    recorded ``/tmp/train_offload`` is checked for room for the node's share of fp32 weights and Adam moments of the
    4-layer model's 61.4e9 parameters, ~687 GiB, which this machine's /tmp need not have). Then the provider path,
    the offload flags, EP 4 and every model flag pass against config.json; what is not built here (SGLang-only serving
    flags dropped when SGLang is absent) is R3, one line (the embedded engine does not serve Inkling); without it the
    dry run passes at TP 4 + SP x EP 4."""
    import importlib.util

    from miles_fixtures import _drop_sglang_only, _flags

    from miles.config.base import ConfigError
    from miles.run.entry import dry_run

    path = HERE / "megatron_inkling.flags"
    argv = without_absent_kernel_flags(fixture_argv(read_fixture(path)[2], subs_for(path, workdir, model_dirs)))
    assert "--custom-model-provider-path" in argv and "--sequence-parallel" in argv
    given = _flags(argv)
    assert given["--offload-train-target"] == ["disk"] and given["--offload-train-disk-dir"] == ["/tmp/train_offload"]
    for flag in ("--rollout-num-gpus-per-engine", "--load"):
        with pytest.raises(ConfigError) as ei:
            dry_run(parse_args(argv + ["--dry-run"]))
        assert str(ei.value).startswith(flag) or f") {flag} " in str(ei.value), ei.value
        assert "\n" not in str(ei.value), ei.value
        argv = _without(argv, flag)
    i = argv.index("--offload-train-disk-dir")
    argv = argv[:i + 1] + [str(workdir / "train_offload")] + argv[i + 2:] + ["--dry-run"]
    if importlib.util.find_spec("sglang") is None:
        changed: dict[str, str] = {}
        argv = _drop_sglang_only(argv, changed, "train.py")
        assert sorted(changed) == ["--sglang-enable-multimodal", "--sglang-mamba-scheduler-strategy"], changed
    refusals = ["--use-rollout-routing-replay: the embedded engine"] if importlib.util.find_spec("sglang") is None else []
    for first in refusals:
        with pytest.raises(ConfigError) as ei:
            dry_run(parse_args(argv))
        assert str(ei.value).startswith(first) and "\n" not in str(ei.value), ei.value
        argv = _without(argv, first.split(" ", 1)[0].rstrip(":"))
    cfg = parse_args(argv)
    assert cfg.train.offload_train_target == "disk" and cfg.train.offload_train_disk_dir == str(workdir / "train_offload")
    assert (cfg.megatron.expert_model_parallel_size, cfg.megatron.tensor_model_parallel_size) == (4, 4)
    assert "role plan" in dry_run(cfg)


@pytest.mark.parametrize("name,cp,pp,ep", [("megatron_kimi_k2", 4, 8, 32), ("megatron_deepseek_v3", 4, 1, 4),
                                           ("kimi_k2_thinking_int4", 4, 8, 32), ("megatron_deepseek_v32", 1, 4, 16)])
def test_mla_commands_without_their_sglang_serving_flags(name: str, cp: int, pp: int, ep: int, workdir: Path,
                                                          model_dirs, plugins_on_path):
    """The recorded Kimi-K2 (bf16, and Kimi-K2-Thinking's int4 QAT script: the same layout) and DeepSeek-V3 commands
    (multi-latent attention at CP 4, Kimi-K2's with PP 8 and an uneven last stage, EP 32 / 4, TP 8 / 1 with
    --sequence-parallel), and DeepSeek-V3.2's (DeepSeek sparse attention at TP 2 x PP 4, uneven, x EP 16; its two
    unset node counts given) are refused on this machine only by their
    SGLang-only serving flags (the embedded engine, which ``--rollout-engine auto`` picks without SGLang, has no
    DP-attention or expert-parallel serving); without them the dry run passes against the real config.json."""
    import importlib.util

    from miles_fixtures import _drop_sglang_only, _flags

    from miles.run.entry import dry_run

    path = HERE / f"{name}.flags"
    argv = without_absent_kernel_flags(fixture_argv(read_fixture(path)[2], subs_for(path, workdir, model_dirs)))
    given = _flags(argv)
    assert [given[f] for f in ("--context-parallel-size", "--pipeline-model-parallel-size",
                               "--expert-model-parallel-size")] == [[str(cp)], [str(pp)], [str(ep)]]
    assert "--multi-latent-attention" in given and "--sequence-parallel" in given
    if importlib.util.find_spec("sglang") is None:
        changed: dict[str, str] = {}
        argv = _drop_sglang_only(argv, changed, "train.py")
        assert changed and all(f.startswith("--sglang-") for f in changed), changed
        assert read_fixture(path)[1] == f"refused: {next(iter(changed))}"      # the first one refused, as expected
    assert "role plan" in dry_run(parse_args(argv + ["--dry-run"]))


def test_qwen3_5_lora_command_keeps_its_sglang_lora_flags(workdir: Path, model_dirs, plugins_on_path):
    """The recorded Qwen3.5-35B-A3B LoRA command (``lora_qwen3_5_35b_a3b``: ``--lora-base-cpu-backup`` with
    ``--colocate``, Megatron-Bridge module paths as ``--target-modules`` with the gated DeltaNet's ``in_proj`` /
    ``out_proj``, ``--experts-shared-outer-loras``, TP 2 + SP, EP 8, full recompute, ``--mtp-num-layers 1``) passes the
    dry run with its SGLang LoRA serving flags: ``--sglang-max-lora-rank 16`` reaches the embedded engine (its
    ``--max-lora-rank``), ``--sglang-lora-backend triton`` is a kernel choice that changes nothing there. Without
    ``--sglang-enable-lora`` the engines get merged weights (its replay adds it: ``# replay-add``, the adapter synced
    as Miles's engines serve it)."""
    from miles.config.sglang import serves_lora_adapters
    from miles.fleet.engines import engine_argv_from_config
    from miles.run.entry import dry_run

    path = HERE / "lora_qwen3_5_35b_a3b.flags"
    argv = without_absent_kernel_flags(fixture_argv(read_fixture(path)[2], subs_for(path, workdir, model_dirs)))
    assert "--lora-base-cpu-backup" in argv and "--mtp-num-layers" in argv
    cfg = parse_args(argv + ["--dry-run"])
    assert cfg.weights.lora_base_cpu_backup and not serves_lora_adapters(cfg.train, cfg.sglang)
    assert cfg.sglang.server_args == {**cfg.sglang.server_args, "max_lora_rank": 16, "lora_backend": "triton"}
    assert "role plan" in dry_run(cfg)
    engine = engine_argv_from_config("embedded", cfg.rollout, sglang=cfg.sglang, hf_checkpoint="/m", host="127.0.0.1",
                                     port=2000, api_key=None, num_gpus=1, base_gpu_id=0, device="cpu", colocate=True)
    assert engine[engine.index("--max-lora-rank") + 1] == "16" and "--enable-lora" not in engine


@pytest.mark.parametrize("name, dropped", [
    ("megatron_moe_glm45_355b_a32b_8node", ["--sglang-dp-size", "--sglang-enable-dp-attention",
                                            "--sglang-enable-dp-lm-head", "--sglang-enable-draft-weights-cpu-backup",
                                            "--sglang-ep-size", "--sglang-moe-dense-tp-size"]),
    ("p2p_profile_glm45_air", ["--sglang-enable-dp-attention", "--sglang-enable-dp-lm-head", "--sglang-ep-size",
                               "--sglang-model-loader-extra-config"]),
])
def test_glm45_commands_without_their_sglang_serving_flags(name: str, dropped: list[str], workdir: Path, model_dirs,
                                                           plugins_on_path):
    """The recorded GLM-4.5 8-node command (TP 8 + SP x PP 4 x CP 2 x EP 16, ``--optimizer-cpu-offload``; DeepEP's
    flags dropped here as for every fixture) and GLM-4.5-Air's p2p profile (PP 4 x EP 8, p2p weight transfer) are
    refused on this machine only by their SGLang-only serving flags; without them the dry run passes."""
    import importlib.util

    from miles_fixtures import _drop_sglang_only

    from miles.run.entry import dry_run

    path = HERE / f"{name}.flags"
    argv = without_absent_kernel_flags(fixture_argv(read_fixture(path)[2], subs_for(path, workdir, model_dirs)))
    if importlib.util.find_spec("sglang") is None:
        changed: dict[str, str] = {}
        argv = _drop_sglang_only(argv, changed, "train.py")
        assert sorted(changed) == dropped, changed
    assert "role plan" in dry_run(parse_args(argv + ["--dry-run"]))
