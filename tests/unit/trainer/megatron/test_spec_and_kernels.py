"""``--spec`` (miles/config/specs.py) and the flags that need a GPU kernel package (miles/config/kernels.py): each
bad input is one line naming the flag, the value and the fix, from the parser, the Megatron backend's preflight
(``--dry-run``) and the real dry run of train.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, parse_args
from miles.config.kernels import KERNEL_FLAGS, check_kernel_flags, importable
from miles.config.specs import SPECS, check_spec
from miles.trainer.megatron import spec as spec_check

REPO = Path(__file__).resolve().parents[4]
GLM5 = ["miles_plugins.models.glm5.glm5", "get_glm5_spec"]


def _cfg(model: Path, *extra: str):
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--train-backend", "megatron", *extra])


def _hf(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


# ------------------------------------------------------------------------------------------- --spec
def test_every_recorded_spec_has_a_row() -> None:
    """The four values Miles v0.1.0's recorded commands pass (tests/snapshots/launch_scripts) are in the table."""
    assert set(SPECS) == {"miles_plugins.models.glm5.glm5 get_glm5_spec",
                          "miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec",
                          "miles_plugins.models.qwen3_5 get_qwen3_5_spec",
                          "miles_plugins.models.qwen3_next get_qwen3_next_spec"}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for spec in SPECS.values():          # each names model types transformers knows
        assert all(t in CONFIG_MAPPING_NAMES for t in spec.model_types), spec


def test_unknown_spec_is_refused_by_the_parser(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(tiny_model_dir, "--spec", "my_plugins.models.foo", "get_foo_spec")
    msg = str(e.value)
    assert msg.startswith("--spec my_plugins.models.foo get_foo_spec: not a layer spec miles knows") and "\n" not in msg
    assert msg.endswith("drop --spec.") and "get_glm5_spec" in msg


def test_spec_mismatching_config_json_is_one_line(tiny_model_dir: Path) -> None:
    cfg = _cfg(tiny_model_dir, "--spec", *GLM5)
    assert cfg.megatron.spec == GLM5
    with pytest.raises(ConfigError) as e:
        spec_check.preflight_check(cfg, _hf(tiny_model_dir))
    assert str(e.value) == ("--spec miles_plugins.models.glm5.glm5 get_glm5_spec is GLM-5 / DeepSeek-V3.2 (DeepSeek "
                            "sparse attention)'s layer spec (config.json model_type glm_moe_dsa or deepseek_v32), but "
                            "--hf-checkpoint's config.json has model_type qwen3: point --hf-checkpoint at a GLM-5 / "
                            "DeepSeek-V3.2 (DeepSeek sparse attention) checkpoint, or drop --spec.")


@pytest.mark.parametrize("key", list(SPECS))
def test_spec_of_a_family_not_built_is_one_line(tiny_model_dir: Path, key: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every spec's family is built today, so the not-built branch is reached through the preflight with the real
    registry minus that spec's family (as on a tree where the family's module is not there yet)."""
    spec = SPECS[key]
    model_type = spec.model_types[0]
    built = {t: name for t, name in spec_check.built_families().items() if t not in spec.model_types}
    assert model_type not in built and "kimi_k2" in built
    monkeypatch.setattr(spec_check, "built_families", lambda: built)
    cfg = _cfg(tiny_model_dir, "--spec", *key.split())
    with pytest.raises(ConfigError) as e:
        spec_check.preflight_check(cfg, {"model_type": model_type})
    assert str(e.value) == (f"--spec {key}: {spec.family} (model_type {model_type}) is not built by the Megatron "
                            f"backend yet (it builds: {', '.join(sorted(built))}); train one of those families.")
    assert "\n" not in str(e.value)


def test_spec_of_a_built_family_is_accepted() -> None:
    check_spec(GLM5, "deepseek_v32", built={"deepseek_v32": "DeepSeek-V3.2"})
    check_spec(["miles_plugins.models.glm5.glm5.get_glm5_spec"], "glm_moe_dsa", built={"glm_moe_dsa": "GLM-5"})
    check_spec(None, "qwen3", built={})


def test_spec_is_checked_in_the_preflight() -> None:
    from miles.run import preflight

    assert {spec_check.preflight_check, spec_check.kernels_check} <= set(preflight.backend_checks("megatron"))


def test_spec_needs_the_megatron_backend(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--spec needs --train-backend megatron \(got --train-backend fsdp\)"):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
                    "--train-backend", "fsdp", "--spec", *GLM5])


# ------------------------------------------------------------------------------------------- kernel packages
@pytest.mark.parametrize("flags,shown,package", [
    (["--moe-grouped-gemm"], "--moe-grouped-gemm", "transformer-engine (Python package transformer_engine)"),
    (["--moe-permute-fusion"], "--moe-permute-fusion", "transformer-engine (Python package transformer_engine)"),
    (["--attention-backend", "fused"], "--attention-backend fused",
     "transformer-engine (Python package transformer_engine)"),
    (["--moe-enable-deepep", "--moe-token-dispatcher-type", "flex"], "--moe-enable-deepep",
     "DeepEP (Python package deep_ep)"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex", "DeepEP (Python package deep_ep)"),
], ids=["grouped_gemm", "permute_fusion", "fused_attention", "deepep", "flex"])
def test_kernel_flag_without_its_package_is_one_line(tiny_model_dir: Path, flags: list[str], shown: str,
                                                     package: str) -> None:
    cfg = _cfg(tiny_model_dir, *flags)
    with pytest.raises(ConfigError) as e:                      # the package absent (as on this CPU box)
        check_kernel_flags(cfg.megatron, importable=lambda module: False)
    msg = str(e.value)
    assert msg.startswith(f"{shown} needs {package}, which does not import here: ") and "\n" not in msg
    assert "pip install" in msg or "github.com/deepseek-ai/DeepEP" in msg
    check_kernel_flags(cfg.megatron, importable=lambda module: True)    # accepted where it imports
    row = next(k for k in KERNEL_FLAGS if k.flag == shown)
    if not importable(row.module):                           # and the preflight says the same here
        with pytest.raises(ConfigError, match="^" + shown):
            spec_check.kernels_check(cfg, _hf(tiny_model_dir))


def test_dsa_attention_backend_tilelang_is_refused_in_one_line(tiny_model_dir: Path) -> None:
    """Miles's GLM-5.1/5.2 LoRA recipes pass --dsa-attention-backend tilelang: refused naming the package where it
    does not import, and where it does (its kernels are not wired here); megatron (the torch path) is accepted."""
    cfg = _cfg(tiny_model_dir, "--dsa-attention-backend", "tilelang")
    assert cfg.megatron.dsa_attention_backend == "tilelang"
    fix = ("use --dsa-attention-backend megatron (DeepSeek sparse attention and its indexer in torch: the same math, "
           "unfused).")
    unwired = ("miles's Megatron backend has no TileLang kernels wired (it runs DeepSeek sparse attention and its "
               "indexer in torch)")
    with pytest.raises(ConfigError) as e:
        check_kernel_flags(cfg.megatron, importable=lambda module: module != "tilelang")
    assert str(e.value) == ("--dsa-attention-backend tilelang needs TileLang (Python package tilelang), which does not "
                            f"import here, and {unwired}; {fix}")
    with pytest.raises(ConfigError) as e:
        check_kernel_flags(cfg.megatron, importable=lambda module: True)
    assert str(e.value) == ("--dsa-attention-backend tilelang: TileLang (Python package tilelang) imports here, but "
                            f"{unwired}; {fix}")
    with pytest.raises(ConfigError, match=r"^--dsa-attention-backend tilelang(:| needs) "):   # the preflight, here
        spec_check.kernels_check(cfg, _hf(tiny_model_dir))
    megatron = _cfg(tiny_model_dir, "--dsa-attention-backend", "megatron")
    check_kernel_flags(megatron.megatron, importable=lambda module: False)
    spec_check.kernels_check(megatron, _hf(tiny_model_dir))
    with pytest.raises(ConfigError, match=r"^--dsa-attention-backend needs --train-backend megatron \(got "
                                          r"--train-backend fsdp\)"):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "2",
                    "--train-backend", "fsdp", "--dsa-attention-backend", "megatron"])


def test_deepep_needs_the_flex_dispatcher(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--moe-enable-deepep needs --moe-token-dispatcher-type flex \(got "
                                          r"alltoall\): add it, or drop --moe-enable-deepep\.$"):
        _cfg(tiny_model_dir, "--moe-enable-deepep", "--moe-token-dispatcher-type", "alltoall")


def test_other_attention_backends_need_no_package(tiny_model_dir: Path) -> None:
    for backend in ("auto", "flash", "unfused", "local"):
        check_kernel_flags(_cfg(tiny_model_dir, "--attention-backend", backend).megatron, importable=lambda m: False)


def test_a_package_that_fails_to_load_counts_as_absent(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "broken_kernels_pkg.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not importable("broken_kernels_pkg") and not importable("no_such_kernels_pkg") and importable("json")


@pytest.mark.skipif(importable("transformer_engine"), reason="transformer-engine imports here: the flag is accepted")
def test_dry_run_refuses_grouped_gemm_without_transformer_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    """train.py --dry-run: one line, exit 2, no traceback."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    out = subprocess.run([sys.executable, "train.py", "--dry-run", "--hf-checkpoint", str(tiny_model_dir),
                          "--prompt-data", str(data), "--num-rollout", "1", "--rollout-batch-size", "1",
                          "--moe-grouped-gemm", "--colocate", "--output-dir", str(tmp_path / "o")],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "--moe-grouped-gemm needs transformer-engine (Python package transformer_engine)" in out.stderr
