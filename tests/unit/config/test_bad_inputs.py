"""Bad inputs a new user gives ``train.py --dry-run`` / ``train_async.py --dry-run``: each ends in one known error
(``ConfigError`` / ``MilesError``: ``run_main`` prints it as one line and exits 2) naming the flag and the value,
and never passes the dry run only to fail at the start. Run in-process through the same ``parse_args`` +
``dry_run`` the entry points call (``miles.run.entry.dry_run``: validation, role plan, ``miles.run.preflight``,
data); the last tests run the real command lines (``--help``, ``--help-all``, ``--version``, a plugin whose
module raises). Ids starting ``guard-`` passed before this file was written and are kept as regression guards;
every other case passed the dry run (or showed a traceback) before its fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import parse_args
from miles.spmd.errors import is_known_error

REPO = Path(__file__).resolve().parents[3]

PLUGINS = {  # module name -> source, written to a folder put on sys.path
    "h11_boom": 'raise RuntimeError("boom at import")\n',
    "h11_syntax": "def f(:\n",
    "h11_ok": "NOT_CALLABLE = 3\n\ndef two(a, b, c, d):\n    return 0\n",
}

# id -> (extra flags; {data} {tmp} are filled in, the message the error must contain)
CASES: dict[str, tuple[list[str], str]] = {
    # numbers argparse takes by type but no run can use
    "lr-nan": (["--lr", "nan"], "--lr must be a finite number, got nan"),
    "lr-inf": (["--lr", "inf"], "--lr must be a finite number, got inf"),
    "rollout-temperature-nan": (["--rollout-temperature", "nan"], "--rollout-temperature must be a finite number"),
    "entropy-coef-nan": (["--entropy-coef", "nan"], "--entropy-coef must be a finite number, got nan"),
    "kl-loss-coef-inf": (["--kl-loss-coef", "inf"], "--kl-loss-coef must be a finite number, got inf"),
    "micro-batch-size-0": (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1, got 0"),
    "dynamic-batch-without-max-tokens": (["--use-dynamic-batch-size"],
                                         "--use-dynamic-batch-size packs micro-batches up to --max-tokens-per-gpu, "
                                         "which is not set: add --max-tokens-per-gpu N"),
    "max-tokens-per-gpu-0": (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"],
                             "--max-tokens-per-gpu must be a positive number of tokens, got 0"),
    "max-tokens-per-gpu-negative": (["--max-tokens-per-gpu", "-5"], "--max-tokens-per-gpu must be a positive"),
    "rollout-max-response-len-0": (["--rollout-max-response-len", "0"],
                                   "--rollout-max-response-len must be a positive number of tokens, got 0"),
    "rollout-max-response-len-negative": (["--rollout-max-response-len", "-1"], "got -1; omit it"),
    "num-epoch-0": (["--num-epoch", "0"], "--num-epoch must be at least 1, got 0"),
    "num-epoch-negative": (["--num-epoch", "-1"], "--num-epoch must be at least 1, got -1"),
    "save-interval-0": (["--save-interval", "0"], "--save-interval must be a positive number of rollouts, got 0"),
    "save-interval-negative": (["--save-interval", "-1"], "--save-interval must be a positive number of rollouts"),
    "eval-interval-negative": (["--eval-interval", "-1"], "--eval-interval must be >= 0"),
    "clip-grad-negative": (["--clip-grad", "-1"], "--clip-grad must be >= 0 (0: no clipping), got -1.0"),
    "adam-beta2-above-1": (["--adam-beta2", "1.5"], "--adam-beta2 must be in [0, 1), got 1.5"),
    "adam-beta1-negative": (["--adam-beta1", "-0.1"], "--adam-beta1 must be in [0, 1), got -0.1"),
    "adam-eps-0": (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0"),
    "weight-decay-negative": (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    "eps-clip-negative": (["--eps-clip", "-0.1"], "--eps-clip must be >= 0 (the PPO clip range), got -0.1"),
    "rollout-top-p-above-1": (["--rollout-top-p", "2"], "--rollout-top-p must be in (0, 1], got 2.0"),
    "rollout-top-k-0": (["--rollout-top-k", "0"], "--rollout-top-k must be -1 (off) or at least 1, got 0"),
    "rollout-top-k-negative": (["--rollout-top-k", "-5"], "--rollout-top-k must be -1 (off) or at least 1, got -5"),
    "eval-top-p-0": (["--eval-top-p", "0"], "--eval-top-p must be in (0, 1], got 0.0"),
    "distributed-timeout-0": (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0"),
    "distributed-timeout-negative": (["--distributed-timeout-minutes", "-1"],
                                     "--distributed-timeout-minutes must be > 0, got -1.0"),
    "master-port-out-of-range": (["--master-port", "70000"], "--master-port must be a TCP port in 1..65535, got 70000"),
    "router-port-out-of-range": (["--sglang-router-ip", "1.2.3.4", "--sglang-router-port", "99999"],
                                 "--sglang-router-port must be a TCP port in 1..65535, got 99999"),
    "engine-max-running-requests-0": (["--engine-max-running-requests", "0"],
                                      "--engine-max-running-requests must be at least 1, got 0"),
    # the --sglang-* sizes the embedded engine takes too (it refused them only once its process started)
    "sglang-max-running-requests-0": (["--rollout-engine", "embedded", "--sglang-max-running-requests", "0"],
                                      "--sglang-max-running-requests must be at least 1, got 0"),
    "sglang-context-length-negative": (["--rollout-engine", "embedded", "--sglang-context-length", "-1"],
                                       "--sglang-context-length must be at least 1, got -1"),
    "sglang-cuda-graph-bs-0": (["--rollout-engine", "embedded", "--sglang-cuda-graph-bs", "0"],
                               "--sglang-cuda-graph-bs must be at least 1, got [0]"),
    "sglang-mem-fraction-above-1": (["--sglang-mem-fraction-static", "2"],
                                    "--sglang-mem-fraction-static must be a fraction of GPU memory in (0, 1), got 2.0"),
    "lr-warmup-iters-negative": (["--lr-warmup-iters", "-5"], "--lr-warmup-iters must be >= 0, got -5"),  # traceback
    "lr-decay-iters-within-warmup": (["--lr-decay-style", "linear", "--lr-warmup-iters", "5", "--lr-decay-iters", "3"],
                                     "--lr-decay-iters (3) must exceed --lr-warmup-iters (5) with --lr-decay-style linear"),
    "rollout-request-timeout-0": (["--rollout-request-timeout", "0"],
                                  "--rollout-request-timeout must be a positive number of seconds, got 0.0"),
    # an unset shell variable: `--save $SAVE` used to mean "no --save" (nothing saved), `--hf-checkpoint ""` no model
    "save-empty": (["--save", ""], "--save was given an empty string (an unset shell variable?)"),
    "hf-checkpoint-empty": (["--hf-checkpoint", ""], "--hf-checkpoint was given an empty string"),
    "prompt-data-empty": (["--prompt-data", ""], "--prompt-data was given an empty string"),
    "custom-rm-path-empty": (["--custom-rm-path", ""], "--custom-rm-path was given an empty string"),
    "custom-config-path-empty": (["--custom-config-path", ""], "--custom-config-path was given an empty string"),
    # applied with os.environ.update at the start: a traceback there before
    "train-env-vars-name-with-equals": (["--train-env-vars", '{{"A=B": "1"}}'],
                                        "argument --train-env-vars: '{{\"A=B\": \"1\"}}': 'A=B' is not an environment "
                                        "variable name"),
    "train-env-vars-empty-name": (["--train-env-vars", '{{"": "1"}}'], "'' is not an environment variable name"),
    # addresses
    "rm-url-not-a-url": (["--rm-type", "remote_rm", "--rm-url", "notaurl"],
                         "--rm-url 'notaurl' is not an http(s) URL: give scheme, host and port"),
    "opd-teacher-url-without-scheme": (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "localhost:30000"],
                                       "--opd-teacher-urls 'localhost:30000' is not an http(s) URL"),
    "opd-teacher-named-url-without-scheme": (
        ["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "math=h:1", "--custom-rm-path",
         "miles.rollout.on_policy_distillation.reward_func", "--custom-reward-post-process-path",
         "miles.rollout.on_policy_distillation.post_process_rewards"], "--opd-teacher-urls 'h:1' is not an http(s) URL"),
    "router-ip-with-scheme": (["--sglang-router-ip", "http://1.2.3.4", "--sglang-router-port", "3000"],
                              "--sglang-router-ip 'http://1.2.3.4' must be a host name or IP address only"),
    # combinations Miles refuses
    "disk-delta-with-colocate": (["--colocate", "--update-weight-transfer-mode", "disk-delta",
                                  "--update-weight-disk-dir", "{tmp}/dd"],
                                 "--update-weight-transfer-mode disk-delta writes weight deltas for separate engines "
                                 "and cannot be used with --colocate"),
    "megatron-with-gradient-checkpointing": (["--train-backend", "megatron", "--gradient-checkpointing"],
                                             "--gradient-checkpointing is not supported by --train-backend megatron "
                                             "(only by --train-backend fsdp): use --recompute-activations"),
    "megatron-with-attn-implementation": (["--train-backend", "megatron", "--attn-implementation", "sdpa"],
                                          "--attn-implementation sdpa is not supported by --train-backend megatron"),
    "fsdp-with-attn-implementation-eager": (["--train-backend", "fsdp", "--attn-implementation", "eager"],
                                            "--attn-implementation eager is not supported: the FSDP trainer packs"),
    "negative-train-memory-margin": (["--train-memory-margin-bytes", "-1"],
                                     "--train-memory-margin-bytes must be >= 0 (0: no cap), got -1"),
    "embedded-engine-with-sglang-only-flag": (["--rollout-engine", "embedded", "--sglang-enable-dp-lm-head"],
                                              "--sglang-enable-dp-lm-head: the embedded engine (--rollout-engine "
                                              "embedded) has no such setting and would ignore it; use "
                                              "--rollout-engine sglang"),
    # output paths and templates (found only when the first rollout was dumped)
    "dump-details-under-a-file": (["--dump-details", "{data}/details"],
                                  "--dump-details {data}/details: {data} is a file, not a directory"),
    "save-debug-rollout-data-under-a-file": (["--save-debug-rollout-data", "{data}/r_{{rollout_id}}.jsonl"],
                                             "--save-debug-rollout-data {data}/r_{{rollout_id}}.jsonl: its directory "
                                             "{data}: {data} is a file"),
    "save-debug-rollout-data-unknown-field": (["--save-debug-rollout-data", "{tmp}/r_{{step}}.jsonl"],
                                              "--save-debug-rollout-data {tmp}/r_{{step}}.jsonl: not a path template "
                                              "(KeyError: 'step'); the only field is {{rollout_id}}"),
    "save-debug-rollout-data-unclosed-brace": (["--save-debug-rollout-data", "{tmp}/r_{{rollout_id"],
                                               "not a path template (ValueError"),
    "save-debug-rollout-data-positional-field": (["--save-debug-rollout-data", "{tmp}/r_{{}}.jsonl"],
                                                 "not a path template (IndexError"),
    "prompt-data-fifo": (["--prompt-data", "{tmp}/fifo.jsonl"],
                         "--prompt-data {tmp}/fifo.jsonl is not a regular file"),  # was: "is a directory"
    "guard-prompt-data-directory": (["--prompt-data", "{tmp}"], "--prompt-data {tmp} is a directory; give a JSONL"),
    # RL without engines: failed at the first rollout, after the trainer had loaded
    "rl-with-debug-train-only": (["--debug-train-only"], "--loss-type policy_loss (RL training) needs rollout engines, "
                                 "but this run has none (--debug-train-only): use --loss-type sft_loss"),
    "rl-with-rollout-num-gpus-0": (["--rollout-num-gpus", "0", "--actor-num-gpus-per-node", "2"],
                                   "needs rollout engines, but this run has none (--rollout-num-gpus 0)"),
    # plugins whose module raises on import (a traceback before)
    "custom-rm-path-import-raises": (["--custom-rm-path", "h11_boom.rm"],
                                     "--custom-rm-path 'h11_boom.rm': importing module 'h11_boom' raised RuntimeError: "
                                     "boom at import (at {plugins}/h11_boom.py:1); fix that module."),
    "custom-generate-import-raises": (["--custom-generate-function-path", "h11_boom.gen"],
                                      "--custom-generate-function-path 'h11_boom.gen': importing module 'h11_boom' "
                                      "raised RuntimeError"),
    "rollout-function-import-raises": (["--rollout-function-path", "h11_boom.fn"],
                                       "--rollout-function-path 'h11_boom.fn': importing module 'h11_boom' raised"),
    "dynamic-filter-import-raises": (["--dynamic-sampling-filter-path", "h11_boom.keep"],
                                     "--dynamic-sampling-filter-path 'h11_boom.keep': importing module 'h11_boom'"),
    "custom-rm-path-syntax-error": (["--custom-rm-path", "h11_syntax.f"],
                                    "importing module 'h11_syntax' raised SyntaxError: invalid syntax (at "
                                    "{plugins}/h11_syntax.py:1)"),
    # regression guards: one line already before
    "guard-lr-not-a-number": (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    "guard-rollout-batch-size-0": (["--rollout-batch-size", "0"], "--rollout-batch-size must be positive, got 0"),
    "guard-n-samples-negative": (["--n-samples-per-prompt", "-1"], "--n-samples-per-prompt must be positive, got -1"),
    "guard-bad-choice": (["--advantage-estimator", "foo"], "argument --advantage-estimator: invalid choice: 'foo'"),
    "guard-custom-config-missing": (["--custom-config-path", "{tmp}/none.yaml"],
                                    "--custom-config-path '{tmp}/none.yaml': cannot read it as YAML"),
    "guard-train-env-vars-malformed": (["--train-env-vars", "{{bad"], "argument --train-env-vars: expected a JSON object"),
    "guard-chat-template-kwargs-list": (["--apply-chat-template-kwargs", "[1]"],
                                        "argument --apply-chat-template-kwargs: expected a JSON object, got '[1]'"),
    "guard-opd-teacher-urls-empty-url": (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "a="],
                                         "'a=' is not NAME=URL"),
    "guard-eval-prompt-data-missing": (["--eval-prompt-data", "ev", "{tmp}/none.jsonl"],
                                       "--eval-prompt-data ev {tmp}/none.jsonl: no such file"),
    "guard-custom-rm-path-not-callable": (["--custom-rm-path", "h11_ok.NOT_CALLABLE"], "names a int, not a function"),
    "guard-custom-rm-path-wrong-signature": (["--custom-rm-path", "h11_ok.two"], "has signature (a, b, c, d)"),
    "guard-rm-type-unknown": (["--rm-type", "foo"], "--rm-type 'foo' is not a known reward"),
    "guard-version-typo": (["--versoin"], "unrecognized argument --versoin"),
    "offload-train-disk-chunk-mb-0": (["--offload-train-disk-chunk-mb", "0"],
                                      "--offload-train-disk-chunk-mb must be a positive number of MiB, got 0"),
    "offload-train-disk-dir-a-file": (["--offload-train", "--offload-train-target", "disk", "--offload-train-disk-dir",
                                       "{data}"], "--offload-train-disk-dir {data}: {data} is a file, not a directory"),
}

# train_async.py refuses --colocate itself first; and --offload-train-target disk (it never pauses the trainer)
ASYNC_DIFFERS = {"disk-delta-with-colocate", "offload-train-disk-dir-a-file"}

# values next to the refused ones that must still pass the dry run (the checks are not too tight)
ACCEPTED = {
    "eval-interval-0-means-off": ["--eval-interval", "0"],
    "chunked-prefill-minus-1-means-no-chunking": ["--rollout-engine", "embedded", "--sglang-chunked-prefill-size", "-1"],
    "cuda-graph-bs-list": ["--rollout-engine", "embedded", "--sglang-cuda-graph-bs", "1", "2", "4"],
    "megatron-recompute-activations": ["--train-backend", "megatron", "--recompute-activations"],
    "dynamic-batch-with-max-tokens": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"],
    "opd-plain-teacher-url": ["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "http://h:1/generate"],
    "save-debug-rollout-data-template": ["--save-debug-rollout-data", "{tmp}/dumps/r_{{rollout_id}}.jsonl"],
    "top-k-1-greedy": ["--rollout-top-k", "1", "--rollout-top-p", "1.0"],
    "sft-with-debug-train-only": ["--debug-train-only", "--loss-type", "sft_loss"],
    "offload-train-target-disk": ["--offload-train", "--offload-train-target", "disk", "--offload-train-disk-dir",
                                  "{tmp}/spill"],
}


@pytest.fixture
def env(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> dict[str, Path]:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, src in PLUGINS.items():
        (plugins / f"{name}.py").write_text(src)
        sys.modules.pop(name, None)
    monkeypatch.syspath_prepend(str(plugins))
    os.mkfifo(tmp_path / "fifo.jsonl")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+0=", "label": str(i)}) + "\n" for i in range(8)))
    return {"tmp": tmp_path, "data": data, "plugins": plugins, "model": tiny_model_dir}


def _argv(env: dict[str, Path], extra: list[str]) -> list[str]:
    base = ["--dry-run", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
            "--hf-checkpoint", str(env["model"]), "--prompt-data", str(env["data"]), "--input-key", "input",
            "--label-key", "label", "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "2",
            "--output-dir", str(env["tmp"] / "out")]
    return base + [e.format(**env) for e in extra]


def _dry_run(argv: list[str], is_async: bool = False) -> str:
    from miles.run.entry import dry_run

    return dry_run(parse_args(argv, is_async=is_async))


@pytest.mark.parametrize(("case", "is_async"), [
    pytest.param(case, is_async, id=f"{case}-{'train_async' if is_async else 'train'}")
    for case in CASES for is_async in (False, True) if not (is_async and case in ASYNC_DIFFERS)])
def test_bad_input_is_one_known_error_line(env: dict[str, Path], case: str, is_async: bool):
    extra, expected = CASES[case]
    with pytest.raises(Exception) as ei:
        _dry_run(_argv(env, extra), is_async=is_async)
    msg = str(ei.value)
    assert is_known_error(ei.value), f"{type(ei.value).__name__} would print a traceback: {msg}"
    assert "\n" not in msg and "Traceback" not in msg
    assert expected.format(**env) in msg


@pytest.mark.parametrize("is_async", [False, True], ids=["train", "train_async"])
def test_missing_hf_checkpoint_fails_the_dry_run_as_it_fails_the_start(env: dict[str, Path], is_async: bool):
    argv = _argv(env, [])
    i = argv.index("--hf-checkpoint")
    with pytest.raises(Exception) as ei:  # the dry run passed before; the start refused it (miles.run.build)
        _dry_run(argv[:i] + argv[i + 2:], is_async=is_async)
    assert is_known_error(ei.value)
    assert str(ei.value) == "--hf-checkpoint DIR is required (a local HF model directory: weights, config, tokenizer)."


def _sglang_importable() -> bool:
    from miles.fleet.engines import sglang_importable

    return sglang_importable()


@pytest.mark.skipif(_sglang_importable(), reason="SGLang is installed here")
def test_rollout_engine_sglang_without_sglang_fails_the_dry_run(env: dict[str, Path]):
    with pytest.raises(Exception) as ei:  # passed before; the start failed on the engine leader
        _dry_run(_argv(env, ["--rollout-engine", "sglang"]))
    assert is_known_error(ei.value)
    assert str(ei.value).startswith("--rollout-engine sglang: the Python package 'sglang' is not importable on this "
                                    "machine")
    assert "role plan:" in _dry_run(_argv(env, ["--rollout-engine", "sglang", "--debug-train-only", "--loss-type",
                                                "sft_loss"]))  # no engines: nothing to start


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_neighbouring_good_values_pass_the_dry_run(env: dict[str, Path], case: str):
    assert "role plan:" in _dry_run(_argv(env, ACCEPTED[case]))


# ---------------------------------------------------------------------------- the real command lines
def _cli(*args: str, cwd: Path = REPO, env_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(env_path) if env_path else os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("entry", ["train.py", "train_async.py"])
def test_help_is_short_and_help_all_lists_every_flag(entry: str):
    short, full = _cli(entry, "--help"), _cli(entry, "--help-all")
    assert short.returncode == 0 and full.returncode == 0, short.stderr + full.stderr
    assert "Traceback" not in short.stdout + short.stderr + full.stdout + full.stderr
    lines = short.stdout.splitlines()
    assert lines[0] == f"usage: {entry} [--flag VALUE ...]   (--help-all: also every --sglang-* and --router-* flag)"
    full_lines = len(full.stdout.splitlines())    # --help was --help-all's length before: every SGLang flag
    assert len(lines) < 0.3 * full_lines, f"--help prints {len(lines)} lines of --help-all's {full_lines}"
    assert "--rollout-batch-size" in short.stdout and "--sglang-mem-fraction-static" in short.stdout
    assert "--sglang-enable-dp-attention" not in short.stdout and "flags, listed by --help-all" in short.stdout
    assert "--sglang-enable-dp-attention" in full.stdout and len(full.stdout.splitlines()) > 2000
    assert "--router-health-success-threshold" in full.stdout and "--router-health-success-threshold" not in short.stdout


@pytest.mark.parametrize("entry", ["train.py", "train_async.py"])
def test_version(entry: str):
    from miles import __version__

    r = _cli(entry, "--version")
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, f"miles {__version__}", "")


def test_plugin_raising_on_import_is_one_line_exit_2(env: dict[str, Path]):
    r = _cli("train.py", *_argv(env, ["--custom-rm-path", "h11_boom.rm"]), env_path=env["plugins"])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert errors == [f"[miles] error: --custom-rm-path 'h11_boom.rm': importing module 'h11_boom' raised RuntimeError: "
                      f"boom at import (at {env['plugins']}/h11_boom.py:1); fix that module."], r.stderr


@pytest.mark.skipif(_sglang_importable(), reason="SGLang is installed here: auto would pick it with a GPU")
@pytest.mark.parametrize("extra", [["--sglang-enable-dp-attention"],
                                   ["--update-weight-transfer-mode", "p2p", "--sglang-enable-dp-attention"]])
def test_dry_run_checks_the_engine_auto_picks_here(env: dict[str, Path], extra: list[str]):
    """--rollout-engine auto (the default) resolves in the dry run as at the start, on the machine running it (here: no
    SGLang, so the embedded engine), and the flags that engine refuses fail the dry run as they fail the start
    (miles.run.build). The dry run passed before and the start refused."""
    with pytest.raises(Exception) as ei:
        _dry_run(_argv(env, extra))
    assert is_known_error(ei.value)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("--sglang-enable-dp-attention: the embedded engine "
                                              "(--rollout-engine auto chose it"), msg
