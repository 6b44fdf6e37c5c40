"""``--chat-template-path`` (Miles's flag): parsed into the data section, checked before anything loads (one line
naming the flag, the value and the fix, at parse / ``--dry-run`` time), Miles's deprecated ``autofix`` read as not
given (with a warning), and passed to SGLang engines as ``--chat-template`` as Miles does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.spmd.errors import is_known_error
from miles.utils.errors import MilesError

BASE = ["--num-rollout", "1", "--rollout-batch-size", "2"]
TEMPLATE = ("{% for m in messages %}##{{ m['role'] | upper }}## {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[[BOT]] {% endif %}")


@pytest.fixture
def template(tmp_path: Path) -> Path:
    p = tmp_path / "chat.jinja"
    p.write_text(TEMPLATE)
    return p


def test_the_flag_lands_in_the_data_section_and_is_no_longer_refused(template: Path):
    assert parse_args(BASE).data.chat_template_path is None
    assert parse_args(BASE + ["--chat-template-path", str(template)]).data.chat_template_path == str(template)
    assert parse_args(BASE + [f"--chat-template-path={template}"]).data.chat_template_path == str(template)


@pytest.mark.parametrize("spelling", [["--chat-template-path", "autofix"], ["--chat-template-path=autofix"]])
def test_autofix_is_read_as_not_given_with_a_warning(spelling: list[str], caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_args(BASE + spelling + ["--rollout-batch-size", "3"])
    assert cfg.data.chat_template_path is None and cfg.data.rollout_batch_size == 3  # nothing else swallowed
    assert any("--chat-template-path autofix is deprecated and read as not given" in r.getMessage()
               for r in caplog.records)


def test_autofix_from_custom_config_is_read_as_not_given(tmp_path: Path, template: Path, caplog):
    doc = tmp_path / "c.yaml"
    doc.write_text("chat_template_path: autofix\n")
    with caplog.at_level(logging.WARNING):
        cfg = parse_args(BASE + ["--chat-template-path", str(template), "--custom-config-path", str(doc)])
    assert cfg.data.chat_template_path is None
    assert any("autofix is deprecated" in r.getMessage() for r in caplog.records)
    doc.write_text(f"chat_template_path: {template}\n")   # a real path from the document is taken as given
    assert parse_args(BASE + ["--custom-config-path", str(doc)]).data.chat_template_path == str(template)


def test_empty_value_is_refused_at_parse_time():
    with pytest.raises(ConfigError, match=r"^--chat-template-path was given an empty string"):
        parse_args(BASE + ["--chat-template-path", ""])


# ---------------------------------------------------------------------------- --dry-run: one line per bad file
@pytest.fixture
def env(tmp_path: Path, tiny_model_dir: Path) -> dict[str, Path]:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": [{"role": "user", "content": f"{i}+0="}], "label": str(i)}) + "\n"
                            for i in range(4)))
    (tmp_path / "syntax.jinja").write_text("{% for m in messages %}{{ m['content'] }}")   # no endfor
    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "latin1.jinja").write_bytes(b"{{ '\xe9' }}")
    return {"tmp": tmp_path, "data": data, "model": tiny_model_dir}


def _dry_run(env: dict[str, Path], *extra: str) -> str:
    from miles.run.entry import dry_run

    argv = ["--dry-run", "--train-backend", "fsdp", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
            "--num-gpus-per-node", "2", "--hf-checkpoint", str(env["model"]), "--prompt-data", str(env["data"]),
            "--input-key", "input", "--label-key", "label", "--rm-type", "math", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--apply-chat-template", "--output-dir", str(env["tmp"] / "out"), *extra]
    return dry_run(parse_args(argv))


@pytest.mark.parametrize(("value", "expected"), [
    ("{tmp}/none.jinja", "--chat-template-path {tmp}/none.jinja: no such file; give the path of a Jinja chat "
                         "template file readable on every node."),
    ("{tmp}", "--chat-template-path {tmp} is a directory; give the path of a Jinja chat template file"),
    ("{tmp}/empty.jinja", "--chat-template-path {tmp}/empty.jinja is empty; give the path"),
    ("{tmp}/latin1.jinja", "--chat-template-path {tmp}/latin1.jinja: cannot be read as UTF-8 text (UnicodeDecodeError"),
    ("{tmp}/syntax.jinja", "--chat-template-path {tmp}/syntax.jinja: the Jinja template does not compile "
                           "(TemplateSyntaxError: Unexpected end of template."),
], ids=["missing", "directory", "empty", "not-utf8", "syntax-error"])
def test_a_bad_template_file_is_one_line_at_dry_run(env: dict[str, Path], value: str, expected: str):
    with pytest.raises(Exception) as ei:
        _dry_run(env, "--chat-template-path", value.format(**env))
    msg = str(ei.value)
    assert is_known_error(ei.value), f"{type(ei.value).__name__} would print a traceback: {msg}"
    assert "\n" not in msg and msg.startswith(expected.format(**env)), msg


def test_a_good_template_passes_the_dry_run(env: dict[str, Path], template: Path):
    out = _dry_run(env, "--chat-template-path", str(template))
    assert f'"chat_template_path": "{template}"' in out


def test_the_start_runs_the_same_check(env: dict[str, Path]):
    """The driver's start runs the same preflight (miles.run.build): the check is not --dry-run only."""
    from miles.run.preflight import preflight

    cfg = parse_args(["--train-backend", "fsdp", "--hf-checkpoint", str(env["model"]), "--prompt-data",
                      str(env["data"]), *BASE, "--rm-type", "math", "--output-dir", str(env["tmp"] / "out"), "--chat-template-path",
                      str(env["tmp"] / "none.jinja")])
    with pytest.raises(MilesError, match=r"^--chat-template-path .*none\.jinja: no such file"):
        preflight(cfg, has_engines=True)


# ---------------------------------------------------------------------------- SGLang engines take the same file
def test_sglang_engines_get_the_file_as_their_chat_template(template: Path):
    from miles.fleet.engines import chat_template_server_flags, engine_argv_from_config

    cfg = parse_args(BASE + ["--chat-template-path", str(template)])
    extra = chat_template_server_flags("sglang", cfg.data, cfg.sglang.server_args)
    assert extra == ["--chat-template", str(template)]
    argv = engine_argv_from_config("sglang", cfg.rollout, hf_checkpoint="/m", host="127.0.0.1", port=3000,
                                   api_key=None, num_gpus=1, base_gpu_id=0, device="cuda", colocate=False,
                                   sglang=cfg.sglang, extra=extra)
    assert argv[argv.index("--chat-template") + 1] == str(template) and argv.count("--chat-template") == 1
    assert chat_template_server_flags("embedded", cfg.data, cfg.sglang.server_args) == []  # no chat endpoint
    assert chat_template_server_flags("sglang", parse_args(BASE).data, {}) == []
    same = parse_args(BASE + ["--chat-template-path", str(template), "--sglang-chat-template", str(template)])
    assert chat_template_server_flags("sglang", same.data, same.sglang.server_args) == []  # given once, by the user
    argv = engine_argv_from_config("sglang", same.rollout, hf_checkpoint="/m", host="127.0.0.1", port=3000,
                                   api_key=None, num_gpus=1, base_gpu_id=0, device="cuda", colocate=False,
                                   sglang=same.sglang)
    assert argv.count("--chat-template") == 1 and argv[argv.index("--chat-template") + 1] == str(template)


def test_a_different_sglang_chat_template_is_refused(template: Path):
    with pytest.raises(ConfigError, match=r"^--chat-template-path .* disagrees with --sglang-chat-template chatml "
                                          r"\(SGLang engines take --chat-template-path's file\): drop"):
        parse_args(BASE + ["--chat-template-path", str(template), "--sglang-chat-template", "chatml"])
    assert parse_args(BASE + ["--sglang-chat-template", "chatml"]).data.chat_template_path is None
