"""--eval-config: Miles's multi-task evaluation document, resolved into one EvalDatasetSpec per dataset in Miles's
order (dataset key, eval.defaults, --eval-* flag, rollout/data flag); bad documents are one line, at parse time and
in the dry run."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from miles.config import ConfigError, parse_args
from miles.config.eval_datasets import EvalDatasetSpec, resolve_eval_datasets
from miles.run.entry import dry_run

BASE = ["--num-rollout", "1", "--rollout-batch-size", "2"]

# Miles v0.1.0 examples/experimental/eval_multi_task/multi_task.yaml
MULTI_TASK = """
eval:
  defaults:
    max_response_len: 16384
    top_p: 0.7
  datasets:
    - name: aime
      path: /root/aime-2024/aime-2024.jsonl
      rm_type: deepscaler
      n_samples_per_eval_prompt: 16
    - name: gpqa    # hf download --repo-type dataset zyzshishui0627/gpqa_diamond --local-dir /root/gpqa
      path: /root/gpqa/gpqa_eval.jsonl
      rm_type: gpqa
      n_samples_per_eval_prompt: 2
"""


def _write(tmp_path: Path, doc: str | dict, name: str = "eval.yaml") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(p)


def _specs(*argv: str) -> list[EvalDatasetSpec]:
    cfg = parse_args([*BASE, *argv])
    return resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout)


def test_miles_multi_task_yaml_resolves_in_miles_order(tmp_path):
    path = _write(tmp_path, MULTI_TASK)
    aime, gpqa = _specs("--eval-config", path, "--eval-temperature", "0.6", "--rollout-top-k", "20",
                        "--eval-input-key", "question", "--label-key", "answer", "--rollout-max-response-len", "99")
    assert (aime.name, aime.path, aime.rm_type, aime.n_samples_per_eval_prompt) == ("aime", "/root/aime-2024/aime-2024.jsonl",
                                                                                   "deepscaler", 16)
    assert (gpqa.rm_type, gpqa.n_samples_per_eval_prompt) == ("gpqa", 2)
    for s in (aime, gpqa):
        assert s.max_response_len == 16384 and s.top_p == 0.7  # eval.defaults over the flags
        assert s.temperature == 0.6       # --eval-temperature (no dataset or default value)
        assert s.top_k == 20              # --eval-top-k unset: --rollout-top-k
        assert s.input_key == "question"  # --eval-input-key over --input-key
        assert s.label_key == "answer"    # --eval-label-key unset: --label-key
        assert s.metadata_key == "metadata" and s.tool_key == "tools" and s.metadata_overrides == {}
    # the parsed values are not rewritten
    cfg = parse_args([*BASE, "--eval-config", path])
    assert cfg.eval.eval_prompt_data is None and cfg.eval.eval_config == path


def test_dataset_keys_win_over_defaults_and_flags_and_per_dataset_keys(tmp_path):
    doc = {"eval": {"defaults": {"temperature": 0.5, "n_samples_per_eval_prompt": 3},
                    "datasets": [{"name": "a", "path": "a.jsonl", "temperature": 0.0, "n_samples_per_eval_prompt": 1,
                                  "stop": ["\n\n"], "stop_token_ids": [7], "min_new_tokens": 2,
                                  "metadata_overrides": {"lang": "en"}, "label_key": "gt", "top_k": 5},
                                 {"name": "b", "path": "b.jsonl"}]}}
    a, b = _specs("--eval-config", _write(tmp_path, doc), "--eval-temperature", "0.9", "--rollout-stop", "END",
                  "--eval-min-new-tokens", "1")
    assert (a.temperature, a.n_samples_per_eval_prompt, a.top_k, a.label_key) == (0.0, 1, 5, "gt")
    assert (b.temperature, b.n_samples_per_eval_prompt, b.top_k) == (0.5, 3, -1)
    assert a.stop == ["\n\n"] and b.stop == ["END"] and a.stop_token_ids == [7] and b.stop_token_ids is None
    assert a.min_new_tokens == 2 and b.min_new_tokens == 1
    assert a.sampling_params(False) == {"max_new_tokens": None, "temperature": 0.0, "top_p": 1.0, "top_k": 5,
                                        "skip_special_tokens": False, "stop": ["\n\n"], "stop_token_ids": [7],
                                        "min_new_tokens": 2}
    assert a.inject_metadata({"kind": "x", "lang": "de"}) == {"kind": "x", "lang": "en"}
    assert b.inject_metadata(None) == {}


def test_rm_type_goes_into_each_samples_metadata(tmp_path):
    doc = {"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "rm_type": "math"}]}}
    (a,) = _specs("--eval-config", _write(tmp_path, doc))
    assert a.inject_metadata({"rm_type": "f1", "k": 1}) == {"rm_type": "math", "k": 1}


def test_mapping_form_root_form_and_base64(tmp_path):
    by_name = {"datasets": {"x": {"path": "x.jsonl", "temperature": 0.1}, "y": {"path": "y.jsonl"}}}  # no `eval:`
    x, y = _specs("--eval-config", _write(tmp_path, by_name))
    assert (x.name, x.temperature, y.name) == ("x", 0.1, "y")
    payload = "base64:" + base64.b64encode(json.dumps({"eval": {"datasets": [{"name": "j", "path": "j.jsonl"}]}})
                                           .encode()).decode()
    assert [s.name for s in _specs("--eval-config", payload)] == ["j"]


def test_eval_prompt_data_gives_the_same_specs_from_the_flags():
    a, b = _specs("--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl", "--n-samples-per-eval-prompt", "4",
                  "--eval-max-response-len", "8")
    assert (a.name, a.path, b.name, b.path) == ("a", "a.jsonl", "b", "b.jsonl")
    assert a.n_samples_per_eval_prompt == b.n_samples_per_eval_prompt == 4 and a.max_response_len == 8
    assert a.temperature == 1.0 and a.rm_type is None and _specs() == []


def test_eval_config_replaces_eval_prompt_data_as_in_miles(tmp_path, caplog):
    specs = _specs("--eval-config", _write(tmp_path, MULTI_TASK), "--eval-prompt-data", "old", "old.jsonl")
    assert [s.name for s in specs] == ["aime", "gpqa"]


def test_defaults_key_miles_ignores_is_ignored_with_a_warning(tmp_path, caplog):
    doc = {"eval": {"defaults": {"rm_type": "math"}, "datasets": [{"name": "a", "path": "a.jsonl"}]}}
    from miles.utils import logging as miles_logging

    miles_logging._warned.clear()   # warn_once: the warning of an earlier test's document must show again
    (a,) = _specs("--eval-config", _write(tmp_path, doc))
    assert a.rm_type is None and "eval.defaults.rm_type is ignored" in caplog.text


@pytest.mark.parametrize("doc, match", [
    ({"eval": {"datasets": [{"name": "a"}]}}, r"dataset 'a': no path: add `path: FILE`"),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "temprature": 0.5}]}},
     r"dataset 'a': unknown key\(s\) temprature; a dataset takes "),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "n_samples_per_eval_prompt": "two"}]}},
     r"dataset 'a': n_samples_per_eval_prompt must be an integer >= 1, got 'two'"),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "top_p": 0}]}}, r"top_p must be a number in \(0, 1\]"),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "stop": "x"}]}}, r"stop must be a list of strings"),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "metadata_overrides": [1]}]}},
     r"metadata_overrides must be a mapping"),
    ({"eval": {"defaults": {"temperature": -1}, "datasets": [{"name": "a", "path": "a.jsonl"}]}},
     r"eval.defaults temperature must be a number >= 0, got -1"),
    ({"eval": {"defaults": {"max_len": 3}, "datasets": [{"name": "a", "path": "a.jsonl"}]}},
     r"unknown key 'max_len' in eval.defaults"),
    ({"eval": {"defaults": {}}}, r"no datasets under eval.datasets; add at least one"),
    ({"eval": {"datasets": []}}, r"no datasets under eval.datasets"),
    ({"eval": {"datasets": [{"path": "a.jsonl"}]}}, r"eval.datasets\[0\] has no name: add `name: NAME`"),
    ({"eval": {"datasets": [{"name": "a", "path": "a"}, {"name": "a", "path": "b"}]}}, r"dataset name\(s\) a appear more"),
    ({"eval": {"datasets": "a.jsonl"}}, r"eval.datasets must be a list of datasets"),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl"}], "delegate": [{"name": "skills"}]}},
     r"eval.delegate is read by an --eval-function-path plugin .*, and none is given .*: add --eval-function-path "
     r"examples.experimental.eval.eval_delegate_rollout.generate_rollout, or drop the delegate section"),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl"}], "tasks": 1}}, r"unknown key\(s\) tasks under eval"),
    ("- a\n- b\n", r"the document must be a mapping"),
    ("eval: [unclosed\n", r"cannot read it as YAML/JSON"),
])
def test_bad_documents_are_one_line_at_parse_time(tmp_path, doc, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_args([*BASE, "--eval-config", _write(tmp_path, doc)])
    msg = str(e.value)
    assert msg.startswith("--eval-config") and "\n" not in msg


def test_unreadable_file_and_bad_base64_are_one_line(tmp_path):
    for value, match in ((str(tmp_path / "missing.yaml"), r"--eval-config '.*missing.yaml': cannot read it"),
                         ("base64:%%%", r"--eval-config base64:...: cannot read it"), ("", r"empty string")):
        with pytest.raises(ConfigError, match=match) as e:
            parse_args([*BASE, "--eval-config", value])
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- the dry run
def _rows(path: Path, n: int) -> str:
    path.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(n)))
    return str(path)


def _dry_cfg(tiny_model_dir: Path, tmp_path: Path, doc: dict):
    return parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", _rows(tmp_path / "train.jsonl", 4),
                       "--label-key", "label", "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "2",
                       "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
                       "--output-dir", str(tmp_path / "out"), "--dry-run", "--eval-config", _write(tmp_path, doc)])


def test_dry_run_checks_each_dataset(tmp_path, tiny_model_dir):
    good = {"eval": {"datasets": [{"name": "a", "path": _rows(tmp_path / "a.jsonl", 2), "rm_type": "exact_match"},
                                  {"name": "b", "path": _rows(tmp_path / "b.jsonl", 3), "rm_type": "math"}]}}
    assert '"eval_config"' in dry_run(_dry_cfg(tiny_model_dir, tmp_path, good))
    missing = {"eval": {"datasets": [{"name": "a", "path": str(tmp_path / "nope.jsonl")}]}}
    with pytest.raises(ConfigError, match=r"--eval-config dataset 'a' path") as e:
        dry_run(_dry_cfg(tiny_model_dir, tmp_path, missing))
    assert "\n" not in str(e.value) and "nope.jsonl" in str(e.value)
    bad_rm = {"eval": {"datasets": [{"name": "a", "path": _rows(tmp_path / "a.jsonl", 2), "rm_type": "nonsense"}]}}
    with pytest.raises(ConfigError, match=r"^--eval-config dataset 'a': rm_type 'nonsense': .*not a known reward"):
        dry_run(_dry_cfg(tiny_model_dir, tmp_path, bad_rm))
    bad_fn = {"eval": {"datasets": [{"name": "a", "path": _rows(tmp_path / "a.jsonl", 2),
                                     "custom_generate_function_path": "no_such_module_xyz.generate"}]}}
    with pytest.raises(ConfigError, match=r"^--eval-config dataset 'a': custom_generate_function_path: .*no_such_module"):
        dry_run(_dry_cfg(tiny_model_dir, tmp_path, bad_fn))


def test_plugins_see_the_specs_as_args_eval_datasets(tmp_path):
    from miles.rollout.plugins import PluginArgs
    from miles.run.build import plugin_extra

    cfg = parse_args([*BASE, "--eval-config", _write(tmp_path, MULTI_TASK)])
    specs = resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout)
    args = PluginArgs(cfg.eval, cfg.data, extra=plugin_extra(cfg, {s.name: s for s in specs}))
    assert [(d.name, d.n_samples_per_eval_prompt) for d in args.eval_datasets] == [("aime", 16), ("gpqa", 2)]
    assert args.eval_config == cfg.eval.eval_config


def test_images_take_eval_config_as_eval_prompt_data(tmp_path):
    """Evaluation sends the images to the engines (image_data), so --eval-config is accepted with --multimodal-keys
    as --eval-prompt-data is; without --apply-chat-template both are one line."""
    cfg = parse_args([*BASE, "--multimodal-keys", '{"image": "images"}', "--apply-chat-template",
                      "--eval-config", _write(tmp_path, MULTI_TASK)])
    assert [s.name for s in resolve_eval_datasets(cfg.eval, cfg.data, cfg.rollout)] == ["aime", "gpqa"]
    with pytest.raises(ConfigError, match=r"needs --apply-chat-template"):
        parse_args([*BASE, "--multimodal-keys", '{"image": "images"}', "--eval-config", _write(tmp_path, MULTI_TASK)])


def test_eval_prompt_data_mistakes_name_that_flag_not_eval_config():
    with pytest.raises(ConfigError, match=r"^--eval-prompt-data '' 'x.jsonl': each NAME and PATH must be non-empty"):
        parse_args([*BASE, "--eval-prompt-data", "", "x.jsonl"])
    with pytest.raises(ConfigError, match=r"^--rollout-top-k must be"):  # a flag's value: its own check, not ours
        parse_args([*BASE, "--eval-prompt-data", "a", "a.jsonl", "--rollout-top-k", "0"])


def test_delegate_section_is_the_eval_functions(tmp_path):
    """eval.delegate is accepted with an --eval-function-path (or a custom --rollout-function-path, which evaluates by
    Miles's default); it stays one line without one, with miles's SFT rollout, or when it is not a list of named
    environments."""
    doc = {"eval": {"datasets": [{"name": "a", "path": "a.jsonl"}],
                    "delegate": [{"name": "skills", "url": "http://h:9050/evaluate", "datasets": [{"name": "aime25"}]}]}}
    path = _write(tmp_path, doc)
    for extra in (["--eval-function-path", "examples.experimental.eval.eval_delegate_rollout.generate_rollout"],
                  ["--rollout-function-path", "my_rollout.generate_rollout"]):
        assert [s.name for s in _specs("--eval-config", path, *extra)] == ["a"]
    for extra in ([], ["--eval-function-path", "miles.rollout.sglang_rollout.generate_rollout"],
                  ["--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss"]):
        with pytest.raises(ConfigError, match=r"^--eval-config: eval.delegate is read by an --eval-function-path plugin"):
            _specs("--eval-config", path, *extra)
    bad = _write(tmp_path, {**doc["eval"], "delegate": {"skills": {"url": "u"}}}, "bad.yaml")
    with pytest.raises(ConfigError, match=r"^--eval-config: eval.delegate must be a list of environments, each a mapping "
                                          r"with a name .*got \{'skills': \{'url': 'u'\}\}\.$"):
        _specs("--eval-config", bad, "--eval-function-path", "m.f")


def test_eval_function_without_datasets_is_one_line_with_eval_interval():
    with pytest.raises(ConfigError, match=r"^--eval-function-path m.f \(with --eval-interval 5\) runs in place of the "
                                          r"evaluation of the --eval-config / --eval-prompt-data datasets, and none is "
                                          r"given \(Miles requires them too\)"):
        parse_args([*BASE, "--eval-function-path", "m.f", "--eval-interval", "5"])
    assert parse_args([*BASE, "--eval-function-path", "m.f"]).eval.eval_function_path == "m.f"  # never called: as Miles
