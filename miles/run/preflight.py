"""Start-up checks shared by ``--dry-run`` and the real start: everything that can be checked without
starting anything, so a dry run that passes starts, and a bad input fails within seconds, before the
tokenizer, the data, the engines or the trainer are loaded.

    preflight(cfg, has_engines=bool(plan.engines))   # ConfigError naming every problem found
    register_backend_check("megatron", check)        # check(cfg, hf_config: dict | None), raises ConfigError

Run by ``miles.run.entry.dry_run`` and, on the driver, by ``miles.run.build`` (its error reaches every rank
with the plan broadcast). Checked:

- model directories (``miles.utils.model_dir``): ``--hf-checkpoint`` (config.json with a ``model_type``
  transformers reads, weights whose safetensors headers match the files' sizes, a tokenizer that loads),
  ``--ref-load``, ``--critic-load``, ``--opd-teacher-load``;
- a run without engines (``--debug-train-only``) has SFT data or a ``--rollout-function-path`` to train on;
  under ``--dry-run``, ``--rollout-engine sglang`` needs SGLang importable on this machine;
- ``--load`` holds a complete checkpoint; ``--prompt-data`` and every ``--eval-prompt-data`` (or ``--eval-config``
  dataset) file exist; ``--chat-template-path`` is a readable Jinja file that compiles; each ``--eval-config``
  dataset's ``rm_type`` is a known reward and its ``custom_generate_function_path`` imports;
- plugins (the ``module.function`` flags): they import and take the arguments they are called with; the
  reward the run builds (``--rm-type`` known, ``--custom-rm-path``, ``--rm-url`` for ``remote_rm``) is
  built here too, by the same ``Rewarder``;
- ``--save``, ``--save-hf`` and ``--output-dir`` can be written (a probe file is created and removed in the
  directory or its nearest existing parent; nothing else is created), and ``--save``'s filesystem has room
  for one checkpoint: parameters (from the safetensors headers) x 4 bytes (fp32 weights), x 3 with the two
  fp32 Adam moments unless ``--no-save-optim``, twice with a PPO critic; so can ``--dump-details`` and the
  directory of ``--save-debug-rollout-data`` (a template whose only field is ``{rollout_id}``);
- ``--train-backend megatron`` (the default) has megatron-core importable (else one line naming
  ``pip install 'miles[megatron]'`` or ``--train-backend fsdp``);
- checks a trainer backend registers for itself (e.g. model-shape flags against config.json; the FSDP backend:
  the packages its transformers model classes import while built, ``miles.trainer.modeling.preflight_check``);
- the embedded engine (named, or what ``--rollout-engine auto`` picks: ``check_engine_kind``): the packages the
  transformers class it serves ``--hf-checkpoint`` with imports while built (``check_embedded_model``; the same
  check as the FSDP trainer's, ``miles.utils.build_imports``), whichever trainer backend runs.

The save checks run on the driver only: ``--save`` must be one filesystem every trainer rank sees.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.base import ConfigError
from miles.utils.errors import MilesError
from miles.utils.logging import get_logger
from miles.utils.model_dir import check_model_dir, load_config, load_tokenizer, num_params, read_chat_template

if TYPE_CHECKING:
    from miles.config import MilesConfig

logger = get_logger(__name__)

BackendCheck = Callable[["MilesConfig", "dict[str, Any] | None"], None]
_BACKEND_CHECKS: dict[str, list[BackendCheck | str]] = {"megatron": ["miles.trainer.megatron.provider.preflight_check",
                                                                    "miles.trainer.megatron.spec.preflight_check",
                                                                    "miles.trainer.megatron.spec.kernels_check",
                                                                    "miles.trainer.megatron.options.preflight_check",
                                                                    "miles.trainer.megatron.dist_ckpt.preflight_check",
                                                                    "miles.trainer.routing_replay.preflight_check"],
                                                       "fsdp": ["miles.trainer.modeling.preflight_check",
                                                                "miles.trainer.routing_replay.preflight_check",
                                                                "miles.trainer.lora_hf.check_fsdp"]}

# Miles's flags naming a ``module.function`` plugin (their config field names). Those with a known calling
# convention are checked for it below; the others must import and be callable. (--custom-model-provider-path: the
# Megatron backend's check, miles.trainer.megatron.provider.preflight_check.)
PLUGIN_FIELDS = (
    "custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path", "custom_loss_function_path",
    "rollout_function_path", "eval_function_path", "custom_reward_post_process_path", "custom_tis_function_path",
    "custom_pg_loss_reducer_function_path", "custom_convert_samples_to_train_data_path", "buffer_filter_path",
    "rollout_sample_filter_path", "rollout_all_samples_process_path", "rollout_data_postprocess_path",
    "custom_rollout_log_function_path", "custom_eval_rollout_log_function_path", "data_source_path",
    "custom_async_data_buffer_path", "custom_update_weight_post_write_path",
    "custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
    "custom_megatron_before_train_step_hook_path", "custom_megatron_post_save_hook_path",
    "session_sample_picker_path", "session_sample_postprocessor_path",
)
GENERATE_FORMS = ("async def generate(args, sample, sampling_params) -> Sample, or Miles's "
                  "async def generate(input: GenerateFnInput) -> GenerateFnOutput")
LOSS_FORMS = "def loss(inputs, algo) -> (per_token_loss, metrics)"
POST_PROCESS_FORMS = "def post_process(args, samples) -> (raw_rewards, rewards)"
FP32_BYTES = 4


def register_backend_check(backend: str, check: BackendCheck | str) -> None:
    """Run ``check(cfg, hf_config)`` in every preflight of ``--train-backend backend``.

    ``hf_config`` is ``--hf-checkpoint``'s config.json as a dict (None without ``--hf-checkpoint``; a bad
    one is reported on its own and the backend checks are skipped). ``check`` raises ``ConfigError``
    naming the flag, its value and the fix (e.g. ``--num-layers 3, but config.json has num_hidden_layers 2``).
    It may be given as a ``"module.function"`` string, imported only when that backend is checked.
    """
    checks = _BACKEND_CHECKS.setdefault(backend, [])
    if check not in checks:
        checks.append(check)


def backend_checks(backend: str) -> list[BackendCheck]:
    out = []
    for check in _BACKEND_CHECKS.get(backend, []):
        if isinstance(check, str):
            module, _, name = check.rpartition(".")
            check = getattr(importlib.import_module(module), name)
        out.append(check)
    return out


def field_value(cfg: MilesConfig, name: str) -> Any:
    """The value of config field ``name`` in whichever section holds it (None when no section has it)."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section) and hasattr(section, name):
            return getattr(section, name)
    return None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ----------------------------------------------------------------------------- paths
def check_hf_checkpoint(path: str) -> Any:
    """--hf-checkpoint: a model directory with a tokenizer; returns its transformers config."""
    check_model_dir(path, "--hf-checkpoint", tokenizer=True)
    config = load_config(path, "--hf-checkpoint", check=False)
    load_tokenizer(path, "--hf-checkpoint", check=False)
    return config


def check_load(load: str, backend: str = "fsdp") -> None:
    """--load: as in Miles, a directory not written yet (or empty) means a fresh start; what is there must load."""
    from miles.trainer.checkpoint import miles_fsdp

    p = Path(load)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--load {load} is a file; point it at a --save directory of an earlier run (or one a "
                          "fresh run will save into).")
    if backend == "megatron" and _megatron_ckpt(load):
        return                                # Megatron-LM's layout: dist_ckpt.preflight_check reads it
    try:
        miles_fsdp.find(load)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_data_file(path: str, flag: str) -> None:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{flag} {path}: no such file; give a JSONL or Parquet file of prompts.")
    if not p.is_file():
        what = "a directory" if p.is_dir() else "not a regular file (a pipe or device cannot be read twice)"
        raise ConfigError(f"{flag} {path} is {what}; give a JSONL or Parquet file of prompts.")


def _megatron_ckpt(path: str) -> bool:
    from miles.trainer.megatron.torch_dist import is_megatron_root

    return is_megatron_root(path)


def path_checks(cfg: MilesConfig) -> list[Callable[[], Any]]:
    """One check per given model directory, --load and data file (each reports on its own)."""
    from miles.rollout.data import parse_eval_prompt_data

    checks: list[Callable[[], Any]] = []
    for name in ("ref_load", "critic_load", "opd_teacher_load"):
        path = field_value(cfg, name)
        if path and not (name == "ref_load" and cfg.train.train_backend == "megatron" and _megatron_ckpt(path)):
            checks.append(lambda path=path, flag=_flag(name): check_model_dir(path, flag))
    if cfg.checkpoint.load:
        checks.append(lambda: check_load(cfg.checkpoint.load, cfg.train.train_backend))
    files = [("--prompt-data", cfg.data.prompt_data)] if cfg.data.prompt_data else []
    if cfg.eval.eval_config:
        from miles.config.eval_datasets import resolve_eval_datasets

        files += [(f"--eval-config dataset {s.name!r} path", s.path)
                  for s in resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout)]
    else:
        files += [(f"--eval-prompt-data {n}", p) for n, p in parse_eval_prompt_data(cfg.eval.eval_prompt_data)]
    checks += [lambda path=path, flag=flag: check_data_file(path, flag) for flag, path in files]
    if cfg.data.chat_template_path:
        checks.append(lambda: read_chat_template(cfg.data.chat_template_path))
    return checks


def check_rollout_source(cfg: MilesConfig) -> None:
    """RL training without engines has nothing to train on (only SFT data or a --rollout-function-path function)."""
    from miles.config.data import custom_rollout_path

    c = cfg.cluster
    why = "--debug-train-only" if c.debug_train_only else "--rollout-num-gpus 0" if c.rollout_num_gpus == 0 else None
    if why and not c.debug_rollout_only and cfg.algo.loss_type != "sft_loss" and custom_rollout_path(cfg.data) is None:
        raise ConfigError(f"--loss-type {cfg.algo.loss_type} (RL training) needs rollout engines, but this run has none "
                          f"({why}): use --loss-type sft_loss with SFT data, give --rollout-function-path, or drop "
                          f"{why}.")


def check_sglang_importable(cfg: MilesConfig) -> None:
    """--dry-run only: --rollout-engine sglang needs the package here (the start checks it on each engine leader)."""
    from miles.fleet.engines import SGLANG_INSTALL_HINT, sglang_importable

    if cfg.rollout.rollout_engine == "sglang" and not sglang_importable():
        raise ConfigError("--rollout-engine sglang: the Python package 'sglang' is not importable on this machine, so "
                          f"an engine started here would fail; install it ({SGLANG_INSTALL_HINT}, GPU only) or use "
                          "--rollout-engine embedded (or auto).")


# ----------------------------------------------------------------------------- plugins
def check_plugin(name: str, path: str) -> None:
    """Import the function of plugin flag ``name`` and check it takes what it will be passed."""
    from miles.rollout.plugins import choose_arity, is_async, load_function

    flag = _flag(name)
    if name == "dynamic_sampling_filter_path":
        from miles.rollout.filters import load_filter

        load_filter(path)
        return
    if name == "eval_function_path":
        from miles.config.eval_datasets import DEFAULT_EVAL_PATHS

        if path in DEFAULT_EVAL_PATHS:  # Miles's default eval rollout names: the built-in evaluation, not imported
            return
    fn = load_function(path, flag)
    if name == "custom_generate_function_path":
        choose_arity(fn, (1, 3), flag, path, GENERATE_FORMS)  # (args, sample, params) or Miles's (input)
        if not is_async(fn):
            raise ConfigError(f"{flag} {path!r} must be a coroutine function ({GENERATE_FORMS}).")
    elif name == "custom_loss_function_path":
        choose_arity(fn, (2,), flag, path, LOSS_FORMS)
    elif name == "custom_reward_post_process_path":
        choose_arity(fn, (2,), flag, path, POST_PROCESS_FORMS)
    elif name == "custom_tis_function_path":
        from miles.trainer.losses import check_tis_signature

        try:
            check_tis_signature(fn, path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif name == "eval_function_path":
        from miles.rollout.eval_fn import check_eval_function

        check_eval_function(fn, path)
    elif name == "rollout_function_path":
        from miles.config.data import custom_rollout_path_of
        from miles.rollout.rollout_fn import check_signature

        if custom_rollout_path_of(path) is not None:  # Miles's default / fully async names are not called
            check_signature(fn, path)


def plugin_checks(cfg: MilesConfig, *, has_engines: bool) -> list[Callable[[], Any]]:
    """The reward (built as the rollout manager builds it, when engines run or one is named), then each plugin."""
    r = cfg.reward
    checks: list[Callable[[], Any]] = []
    if has_engines or r.rm_type or r.custom_rm_path:
        from miles.rollout.rewards import Rewarder

        gen = bool(cfg.data.custom_generate_function_path)  # it may set sample.reward itself
        checks.append(lambda: Rewarder(r, rewards_from_generate=gen))  # --rm-type known, --custom-rm-path ...
    for name in PLUGIN_FIELDS:
        path = field_value(cfg, name)
        if path and name != "custom_rm_path":
            checks.append(lambda name=name, path=path: check_plugin(name, path))
    if cfg.eval.eval_config:
        checks.append(lambda: check_eval_datasets(cfg))
    return checks


def check_eval_datasets(cfg: MilesConfig) -> None:
    """--eval-config's per-dataset rm_type (a known reward, unless --custom-rm-path scores every sample) and
    custom_generate_function_path (imports, takes what it is passed)."""
    from miles.config.eval_datasets import resolve_eval_datasets
    for spec in resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout):
        where = f"--eval-config dataset {spec.name!r}"
        if spec.rm_type and not cfg.reward.custom_rm_path:
            from miles.rollout.rewards import Rewarder

            try:
                Rewarder(dataclasses.replace(cfg.reward, rm_type=spec.rm_type, group_rm=False))
            except ConfigError as e:
                raise ConfigError(f"{where}: rm_type {spec.rm_type!r}: {e}") from None
        path = spec.custom_generate_function_path
        if path and path != cfg.data.custom_generate_function_path:
            try:
                check_plugin("custom_generate_function_path", path)
            except ConfigError as e:
                raise ConfigError(f"{where}: custom_generate_function_path: {e}") from None


# ----------------------------------------------------------------------------- writable outputs
def nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(path: str | Path, flag: str) -> Path:
    """Create and remove a probe file in ``path`` or its nearest existing parent; returns that directory."""
    target = nearest_existing(Path(path))
    if not target.is_dir():
        raise ConfigError(f"{flag} {path}: {target} is a file, not a directory; give a directory path.")
    probe = target / f".miles-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        where = "" if target == Path(path).absolute() else f" (its nearest existing parent {target})"
        raise ConfigError(f"{flag} {path}: cannot write there{where}: {e.strerror or e}; give a directory this user "
                          "can write (a writable, mounted filesystem), or fix its permissions.") from None
    return target


def checkpoint_bytes(cfg: MilesConfig) -> int | None:
    """Estimated size of one --save checkpoint, or None when the parameter count is unknown."""
    if not cfg.train.hf_checkpoint:
        return None
    n = num_params(cfg.train.hf_checkpoint)
    if not n:
        return None
    per_model = n * FP32_BYTES * (1 if cfg.checkpoint.no_save_optim else 3)
    critic = cfg.algo.advantage_estimator == "ppo" and cfg.algo.loss_type != "sft_loss"
    return per_model * (2 if critic else 1)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def check_save(cfg: MilesConfig, *, estimate: bool = True) -> None:
    """--save writable with room for one checkpoint (when ``estimate``); --save-hf and --output-dir writable."""
    from miles.run.metrics import default_output_dir

    ck = cfg.checkpoint
    if ck.save and not cfg.cluster.debug_rollout_only:  # without a trainer nothing is saved
        target = check_writable(ck.save, "--save")
        need = checkpoint_bytes(cfg) if estimate else None
        if need is not None:
            free = shutil.disk_usage(target).free
            if free < need:
                optim = "fp32 weights" if ck.no_save_optim else "fp32 weights + 2 fp32 Adam moments"
                raise ConfigError(f"--save {ck.save}: one checkpoint needs about {_gib(need)} ({optim} of "
                                  f"--hf-checkpoint's {num_params(cfg.train.hf_checkpoint):,} parameters), but "
                                  f"{target} has {_gib(free)} free; free space there or point --save at a larger "
                                  "filesystem.")
    if ck.save_hf and not cfg.cluster.debug_rollout_only:
        check_writable(ck.save_hf, "--save-hf")
    check_writable(default_output_dir(cfg.output), "--output-dir")


def offload_disk_bytes(cfg: MilesConfig) -> int | None:
    """A lower bound of what ``--offload-train-target disk`` spills on the driver's node: the trainer state (fp32
    weights and, where the optimizer state is spilled, two fp32 Adam moments, per --hf-checkpoint parameter; twice
    with a PPO critic; LoRA: the adapters' state left out) over the trainer ranks, times the ranks on one node. None
    when the parameter count is unknown."""
    t, c = cfg.train, cfg.cluster
    n = num_params(t.hf_checkpoint) if t.hf_checkpoint else None
    if not n:
        return None
    kept = t.fsdp_cpu_offload if t.train_backend == "fsdp" else getattr(cfg.megatron, "optimizer_cpu_offload", False)
    if t.train_backend == "fsdp" and kept:
        policy = 0                                  # --fsdp-cpu-offload: the policy stays in host memory
    else:
        policy = n * FP32_BYTES * (1 if t.lora_rank or kept else 3)
    critic = n * FP32_BYTES * 3 if cfg.algo.advantage_estimator == "ppo" and cfg.algo.loss_type != "sft_loss" else 0
    ranks = max(c.actor_num_nodes * c.actor_num_gpus_per_node, 1)
    return (policy + critic) * min(ranks, max(c.num_gpus_per_node, 1)) // ranks


def check_offload_disk(cfg: MilesConfig, *, estimate: bool = True) -> None:
    """--offload-train-target disk: its directory (--offload-train-disk-dir, or Miles's default) creatable and
    writable, with room for the driver's node's share of the trainer state (``offload_disk_bytes``, when
    ``estimate``); a tmpfs there is one warning. Each rank checks its own node again when it creates its directory
    and before each spill."""
    t = cfg.train
    if t.offload_train_target != "disk" or cfg.cluster.debug_rollout_only:
        return
    from miles.trainer.disk_offload import RAM_FILESYSTEMS, filesystem_type

    root = t.offload_disk_root
    flag = "--offload-train-disk-dir" if t.offload_train_disk_dir else \
        "--offload-train-disk-dir (not given: Miles's default $SCRATCH/miles_train_offload_<uid>)"
    target = check_writable(root, flag)
    need = offload_disk_bytes(cfg) if estimate else None
    if need is not None:
        free = shutil.disk_usage(target).free
        if free < need:
            raise ConfigError(f"{flag} {root}: the trainer state spilled there while the engines generate needs about "
                              f"{_gib(need)} on this node (fp32 weights and Adam moments of --hf-checkpoint's "
                              f"{num_params(t.hf_checkpoint):,} parameters, this node's share), but {target} has "
                              f"{_gib(free)} free; free space there or point --offload-train-disk-dir at a larger "
                              "node-local filesystem.")
    fstype = filesystem_type(root)
    if fstype in RAM_FILESYSTEMS:
        logger.warning("--offload-train-disk-dir %s is on a %s: the spilled trainer state would stay in RAM; point it "
                       "at node-local disk (NVMe).", root, fstype)


def check_dumps(cfg: MilesConfig) -> None:
    """--save-debug-rollout-data: a path template taking only ``{rollout_id}``, in a writable place; --dump-details
    writable."""
    out = cfg.output
    if out.save_debug_rollout_data:
        template = out.save_debug_rollout_data
        try:
            first = template.format(rollout_id=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"--save-debug-rollout-data {template}: not a path template ({type(e).__name__}: {e}); "
                              "the only field is {rollout_id}, e.g. --save-debug-rollout-data dumps/{rollout_id}.pt "
                              "(write a literal brace as {{ or }}).") from None
        check_writable(Path(first).parent, f"--save-debug-rollout-data {template}: its directory")
    if out.dump_details:
        check_writable(out.dump_details, "--dump-details")


def check_micro_batch_budget(cfg: MilesConfig, dataset: Any) -> None:
    """With ``--use-dynamic-batch-size`` a micro-batch holds whole samples of at most ``--max-tokens-per-gpu`` tokens
    (x ``--context-parallel-size``), and every sample holds its prompt: a prompt longer than that can never be trained
    on. Checked on the tokenized ``--prompt-data`` (the driver's start and ``--dry-run``), so such a budget (e.g.
    ``--max-tokens-per-gpu 1``) is one line before anything starts, not a failure of the first training step."""
    t = cfg.train
    if not t.use_dynamic_batch_size or not t.max_tokens_per_gpu or dataset is None or not len(dataset):
        return
    cp = int(getattr(cfg.megatron, "context_parallel_size", None) or 1) if t.train_backend == "megatron" else 1
    budget = t.max_tokens_per_gpu * cp
    longest = max(range(len(dataset)), key=lambda i: len(dataset[i].prompt_ids))
    n = len(dataset[longest].prompt_ids)
    if n > budget:
        times_cp = f" x --context-parallel-size {cp} = {budget}" if cp > 1 else ""
        resp = cfg.rollout.rollout_max_response_len
        need = -(-(n + (resp or 1)) // cp)
        plus = f"that prompt + --rollout-max-response-len {resp}" if resp else "that prompt + a response"
        raise ConfigError(f"--max-tokens-per-gpu {t.max_tokens_per_gpu}{times_cp} is smaller than the longest prompt of "
                          f"--prompt-data ({n} tokens, row {dataset[longest].index + 1}): with --use-dynamic-batch-size "
                          f"a micro-batch holds whole samples (prompt + response), so raise --max-tokens-per-gpu to at "
                          f"least {need} ({plus}{', over the CP ranks' if cp > 1 else ''}).")


# ----------------------------------------------------------------------------- all of it
def check_engine_kind(cfg: MilesConfig, kind: str) -> None:
    """What the engine ``--rollout-engine auto`` resolved to (``miles.fleet.engines.resolve_engine_kind``) must take
    the run's flags: p2p weight transfer needs the embedded engine, and the embedded engine refuses the
    ``--sglang-*`` flags it cannot honour and ``--use-rollout-routing-replay`` of a family it does not record (as
    when it is named). The start checks the engine it picks on the
    driver; ``--dry-run`` the one it would pick on the machine running it."""
    if kind == "sglang" and cfg.weights.update_weight_transfer_mode == "p2p":
        from miles.config.validate import P2P_NEEDS_EMBEDDED

        raise ConfigError(P2P_NEEDS_EMBEDDED)
    if kind == "embedded" and cfg.rollout.rollout_engine == "auto":
        from miles.config.sglang import check_embedded_engine

        why = "--rollout-engine auto chose it: no GPU, or SGLang not importable"
        check_embedded_engine(cfg.sglang, why=why)
        if cfg.algo.use_rollout_routing_replay and cfg.train.hf_checkpoint:
            from miles.trainer.routing_replay import check_embedded_r3

            check_embedded_r3(_config_dict(cfg.train.hf_checkpoint), why=why)
        check_embedded_model(cfg, why=why)


def check_embedded_model(cfg: MilesConfig, *, why: str) -> None:
    """The embedded engine builds ``--hf-checkpoint`` with a transformers class whatever the trainer builds: the
    packages that class imports while built are checked as the FSDP trainer's are (one implementation:
    ``miles.utils.build_imports.check_embedded_engine_build``), so a Megatron run (or ``--debug-rollout-only``)
    serving Inkling's released layout without scipy stops here, not at the engine's build. ``why``: how the embedded
    engine was chosen."""
    if not cfg.train.hf_checkpoint:
        return
    from miles.utils.build_imports import check_embedded_engine_build

    check_embedded_engine_build(cfg.train.hf_checkpoint, why=why)


def check_lora_adapter_sync(cfg: MilesConfig) -> None:
    """``--sglang-enable-lora`` with ``--lora-rank``: the engines serve the adapters, which the weight sync sends by
    ``/load_lora_adapter_from_tensors`` (colocated) or ``/load_lora_adapter_from_distributed`` (broadcast to separate
    engines); p2p and disk-delta are refused (``miles.weight_sync.base``)."""
    from miles.config.sglang import serves_lora_adapters

    if serves_lora_adapters(cfg.train, cfg.sglang):
        from miles.weight_sync.base import check_lora_adapter_mode, resolve_mode

        check_lora_adapter_mode(resolve_mode(cfg.weights, cfg.cluster.colocate))


def preflight(cfg: MilesConfig, *, has_engines: bool) -> None:
    """Run every check; one ConfigError listing each problem (a single problem is raised as it is)."""
    problems: list[Exception] = []

    def attempt(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (ConfigError, MilesError) as e:
            problems.append(e)
            return None

    attempt(lambda: check_rollout_source(cfg))
    if cfg.train.train_backend == "megatron" and not cfg.cluster.debug_rollout_only:
        from miles.trainer.megatron import require_megatron_core

        attempt(require_megatron_core)
    if has_engines and cfg.output.dry_run:
        attempt(lambda: check_sglang_importable(cfg))
    hf = cfg.train.hf_checkpoint
    if not hf:  # the start refuses it too (miles.run.build), after the role plan
        problems.append(ConfigError("--hf-checkpoint DIR is required (a local HF model directory: weights, config, "
                                    f"tokenizer){', got an empty string' if hf == '' else ''}."))
    hf_ok = not hf or attempt(lambda: check_hf_checkpoint(hf)) is not None
    for check in (attempt(lambda: path_checks(cfg)) or []) + plugin_checks(cfg, has_engines=has_engines):
        attempt(check)
    attempt(lambda: check_save(cfg, estimate=hf_ok))  # the size estimate reads --hf-checkpoint's headers
    attempt(lambda: check_offload_disk(cfg, estimate=hf_ok))
    attempt(lambda: check_dumps(cfg))
    if has_engines:
        attempt(lambda: check_lora_adapter_sync(cfg))
    if hf_ok:
        config_dict = _config_dict(cfg.train.hf_checkpoint)
        attempt(lambda: check_model_name(cfg.train.model_name, config_dict))
        for check in backend_checks(cfg.train.train_backend):
            attempt(lambda check=check: check(cfg, config_dict))
        if has_engines and cfg.rollout.rollout_engine == "embedded":   # auto: check_engine_kind, once it is picked
            attempt(lambda: check_embedded_model(cfg, why="--rollout-engine embedded"))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigError(f"{len(problems)} problems found before starting: "
                          + " ".join(f"({i}) {e}" for i, e in enumerate(problems, 1)))
    logger.info("preflight passed: model directories, data files, plugins, outputs, backend checks")


def _squash(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def check_model_name(name: str | None, hf_config: dict[str, Any] | None) -> None:
    """``--model-name``: Miles picks its Megatron -> HF weight converter by this name (its default: the config
    class's name, e.g. deepseekv4config). Both backends here read the names from config.json's model_type, so the
    name must name that model: it contains the model type or the transformers config class's stem (case, ``-`` and
    ``_`` ignored, as Miles compares them)."""
    if name is None or hf_config is None:
        return
    from transformers import CONFIG_MAPPING

    from miles.utils.hf_aliases import ALIASES

    model_type = str(hf_config.get("model_type", ""))
    types = [t for t in (model_type, ALIASES.get(model_type)) if t]      # kimi_k2: DeepSeek-V3's config class
    stems = {_squash(t) for t in types} | {_squash(CONFIG_MAPPING[t].__name__.removesuffix("Config"))
                                           for t in types if t in CONFIG_MAPPING}
    if not any(s in _squash(name) for s in stems):
        raise ConfigError(f"--model-name {name} does not name --hf-checkpoint's model (config.json model_type "
                          f"{model_type or '(none)'}): miles reads the weight names from config.json, so drop the flag "
                          f"or name that model (e.g. {_squash(model_type) or 'its model type'}).")


def _config_dict(hf_checkpoint: str | None) -> dict[str, Any] | None:
    if not hf_checkpoint:
        return None
    return json.loads((Path(hf_checkpoint) / "config.json").read_text())
