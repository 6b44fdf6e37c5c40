"""Miles v0.1.0's recorded training commands as fixtures (tests/fixtures/miles_scripts/*.flags): reading them,
the local data and files their placeholders stand for, and the tiny CPU scale the replay tier runs them at.

External services Miles's scripts start before train.py get local stand-ins: ``skills_stand_in`` (the eval
delegate's evaluation server), ``lean_stand_in`` (the kimina Lean server the formal-math reward checks proofs on) and
``teacher_stand_ins`` (the OPD teacher SGLang servers, as embedded engines).

A fixture is one flag per line with ``{MODEL}``, ``{DATA}``, ``{OUT}`` placeholders and ``# key: value`` headers
(``source``, ``entry``, ``expect``, ``model``, ``data``). ``tiny_replay(path, workdir)`` maps it to a command of 2 rollouts
on a CPU world of at most 4 ranks: the model-shape flags to a tiny model of the same family (built locally from
the recorded model's config.json, shrunk), GPU counts and parallel sizes to the CPU world, batch and length sizes
to tiny values, paths to local files; every other flag as recorded (``SCALED_FLAGS`` lists the ones changed).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import re
import shlex
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent / "fixtures" / "miles_scripts"
FIXTURES = sorted(HERE.glob("*.flags"))
MODELS = HERE / "models"
PLUGINS = HERE / "plugins"
PLUGIN_FOLDERS = (PLUGINS, PLUGINS / "examples" / "experimental" / "search-r1",
                  PLUGINS / "examples" / "experimental" / "tau-bench")


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


def fixture_header(path: Path, key: str) -> str | None:
    """The value of a fixture's ``# key:`` line, or None."""
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].strip()
    return None


def fixture_model(path: Path) -> str | None:
    """The ``# model:`` name of a fixture (a config in models/), or None for the tiny model."""
    return fixture_header(path, "model")


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


def fixture_data(path: Path) -> str:
    """The data file ``{DATA}`` names for a fixture: its ``# data: NAME`` header's NAME.jsonl (``lean``: Lean 4
    theorems, the formal-math script's), else geo.jsonl for a script with images, else data.jsonl."""
    name = fixture_header(path, "data")
    if name:
        return f"{name}.jsonl"
    return "geo.jsonl" if uses_images(read_fixture(path)[2]) else "data.jsonl"


def multi_task_yaml(data: Path, ifbench: bool = True) -> str:
    """Miles's examples/experimental/eval_multi_task/multi_task.yaml (aime, gpqa, ifbench), dataset paths ``data``."""
    ifbench_entry = (f"    - name: ifbench\n      path: {data}\n      rm_type: ifbench\n"
                     "      n_samples_per_eval_prompt: 1\n") if ifbench else ""
    return ("eval:\n  defaults:\n    max_response_len: 16384\n    top_p: 0.7\n  datasets:\n"
            f"    - name: aime\n      path: {data}\n      rm_type: deepscaler\n      n_samples_per_eval_prompt: 16\n"
            f"    - name: gpqa\n      path: {data}\n      rm_type: gpqa\n      n_samples_per_eval_prompt: 2\n"
            f"{ifbench_entry}")


def lean_rows(rows: int) -> list[dict]:
    """Prompts as Miles's formal-math data (flc_train.jsonl): a Lean 4 theorem with ``sorry`` in a code block."""
    return [{"prompt": "Complete the following Lean 4 code:\n\n```lean4\nimport Mathlib\n\n"
                       f"theorem add_{i} : ({i} : ℕ) + 1 = {i + 1} := by\n  sorry\n```", "label": str(i + 1)}
            for i in range(rows)]


def eval_delegate_yaml(data: Path, ifbench: bool = True, url: str = "http://skills_server:9050/evaluate") -> str:
    """Miles's multi_tasks.yaml (the --eval-config of its eval delegate scripts), dataset paths ``data``, its
    delegate evaluation server at ``url``."""
    ifbench_entry = (f"    - name: ifbench\n      path: {data}\n      rm_type: ifbench\n"
                     "      n_samples_per_eval_prompt: 1\n") if ifbench else ""
    return ("eval:\n  defaults:\n    n_samples_per_eval_prompt: 1\n    temperature: 0.6\n    top_p: 0.95\n"
            "    top_k: -1\n    max_response_len: 24576\n  datasets:\n"
            f"    - name: gpqa\n      path: {data}\n      rm_type: gpqa\n      n_samples_per_eval_prompt: 2\n"
            f"{ifbench_entry}"
            f"  delegate:\n    - name: skills\n      url: {url}\n      timeout_secs: 7200\n"
            "      max_retries: 5\n      headers: {}\n      datasets:\n"
            "        - name: aime25\n          max_response_len: 8192\n          n_samples_per_eval_prompt: 8\n"
            "        - name: arena-hard\n          n_samples_per_eval_prompt: 2\n"
            "        - name: hle\n          max_response_len: 32768\n")


def dapo_heldout_yaml(data: Path, max_response_len: int = 24576) -> str:
    """Miles's eval_dapo_heldout.yaml (radixark/miles@v0.1.0:examples/on_policy_distillation/qwen3_5_35b_selfdistill/,
    the --eval-config of its self-distillation scripts), its held-out dataset ``data``: prompt / label keys, one
    sample per prompt, the evaluation samples tagged ``opd_reward_mode: eval_math`` for ``reward_func_pure_opd``."""
    return ("eval:\n  defaults:\n    temperature: 0.6\n    top_p: 0.95\n  datasets:\n"
            f"    - name: dapo_heldout\n      path: {data}\n      input_key: prompt\n      label_key: label\n"
            f"      n_samples_per_eval_prompt: 1\n      max_response_len: {max_response_len}\n"
            "      metadata_overrides:\n        opd_reward_mode: eval_math\n")


def write_workdir(out: Path, rows: int = 256, skills_url: str | None = None) -> Path:
    """The files the fixtures' placeholders name: data.jsonl (``rows`` arithmetic prompts, in every key a script
    reads), geo.jsonl + geo.png (geo3k's image rows), lean.jsonl (Lean 4 theorems), mis.yaml,
    eval_delegate_multi_tasks.yaml, multi_task.yaml, eval_dapo_heldout.yaml."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    items = [{"prompt": f"{i}+1=", "label": str(i + 1), "reward_model": str(i + 1), "index": i,
              "messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
             for i in range(rows)]
    data.write_text("".join(json.dumps(row) + "\n" for row in items))
    # geo3k's rows (the VLM fixtures, --multimodal-keys {"image": "images"}): a question with one <image>, as SFT
    # messages and as geo3k_imgurl's problem / answer columns (the GRPO script's --input-key / --label-key)
    from PIL import Image

    Image.new("RGB", (64, 48), (120, 30, 200)).save(out / "geo.png")
    (out / "geo.jsonl").write_text("".join(json.dumps(
        {"messages": [{"role": "user", "content": f"<image>Find x. ({i})"}, {"role": "assistant", "content": str(i)}],
         "problem": f"<image>Find x. ({i})", "answer": str(i), "images": ["geo.png"]}) + "\n"
        for i in range(rows)))
    (out / "lean.jsonl").write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in lean_rows(rows)))
    # the keys of Miles's examples/infra_features/train_infer_mismatch_helper/mis.yaml that name flags here
    (out / "mis.yaml").write_text("use_tis: true\ntis_mode: truncate\ntis_upper_bound: 2.0\n")
    # Miles's examples/experimental/eval/scripts/multi_tasks.yaml, its dataset paths our data (its ifbench dataset
    # needs IFBench's evaluation_lib)
    (out / "eval_delegate_multi_tasks.yaml").write_text(
        eval_delegate_yaml(data, ifbench=False, **({"url": skills_url} if skills_url else {})))
    # Miles's examples/experimental/eval_multi_task/multi_task.yaml, the same way (ifbench tested on its own)
    (out / "multi_task.yaml").write_text(multi_task_yaml(data, ifbench=False))
    (out / "eval_dapo_heldout.yaml").write_text(dapo_heldout_yaml(data))
    return out


def uses_images(lines: list[str]) -> bool:
    return any(ln.startswith("--multimodal-keys") for ln in lines)


# ------------------------------------------------------------------------------------------- tiny models
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shrink_config(real: dict, vocab_size: int, token_ids: dict[str, int | None]) -> dict:
    """A tiny config.json of the same family as ``real``: every size field shrunk, every other field kept (rope
    theta, norm eps, tied embeddings, router kind, MLA or not, MoE layer pattern kind, MTP layers)."""
    c = dict(real)
    for k in ("architectures", "quantization_config", "auto_map"):
        c.pop(k, None)
    c.update(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_attention_heads=8, **token_ids)
    mla = "kv_lora_rank" in c     # 8 heads, 4 KV heads: TP 2 x CP 2 (all-to-all CP splits a TP rank's heads) divides both
    c["num_key_value_heads"] = 8 if mla or real.get("num_key_value_heads") == real.get("num_attention_heads") else 4
    if mla:
        c.update(q_lora_rank=24 if real.get("q_lora_rank") else None, kv_lora_rank=16, qk_nope_head_dim=12,
                 qk_rope_head_dim=8, v_head_dim=10, head_dim=8, qk_head_dim=20)
    else:
        c["head_dim"] = 8
    dense_first = int(real.get("first_k_dense_replace", 0) or 0)
    c["num_hidden_layers"] = 3 if dense_first or real.get("mlp_only_layers") else 2
    if dense_first:
        c["first_k_dense_replace"] = 1
    if real.get("mlp_only_layers"):
        c["mlp_only_layers"] = [0]
    if "mlp_layer_types" in c:
        c["mlp_layer_types"] = ["dense"] + ["sparse"] * (c["num_hidden_layers"] - 1) if dense_first else \
            ["sparse"] * c["num_hidden_layers"]
    if "layer_types" in c:
        c["layer_types"] = c["layer_types"][:c["num_hidden_layers"]]
    for key in ("num_experts", "n_routed_experts"):
        if real.get(key):
            c[key] = 4
    if real.get("num_experts_per_tok"):
        c["num_experts_per_tok"] = 2
    if real.get("moe_intermediate_size"):
        c["moe_intermediate_size"] = 32
    if real.get("shared_expert_intermediate_size"):
        c["shared_expert_intermediate_size"] = 32
    if real.get("n_shared_experts"):
        c["n_shared_experts"] = 1
    if (real.get("n_group") or 1) > 1:
        c.update(n_group=2, topk_group=1)
    return c


def build_family_model(out: Path, model: str | None, seed: int = 0) -> Path:
    """A tiny random model of the family of ``models/<model>.json`` (None: the Qwen3 test model), with the tiny
    tokenizer, written as save_pretrained does; routers drawn at random so that routing differs between tokens.
    ``seed``: its random weights (an OPD teacher stand-in differs from the student)."""
    if (out / "config.json").exists():
        return out
    if model is None:
        from miles.utils.tiny_model import build_tiny_model

        return build_tiny_model(out, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4, seed=seed)
    real = json.loads((MODELS / f"{model}.json").read_text())
    mt = real["model_type"]
    if mt == "qwen3_vl":
        from miles.utils.tiny_vlm import build_tiny_vlm

        return build_tiny_vlm(out, tie_word_embeddings=bool(real.get("tie_word_embeddings", False)))
    if mt in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"):     # hybrid DeltaNet families: their own builder
        from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

        text = real.get("text_config") or real
        theta = float((text.get("rope_parameters") or {}).get("rope_theta", text.get("rope_theta", 10000.0)))
        return build_tiny_qwen35_model(out, kind="qwen3_next" if mt == "qwen3_next" else "qwen3_5_moe",
                                       vlm="text_config" in real, mtp=bool(text.get("mtp_num_hidden_layers")),
                                       rope_theta=theta, seed=seed)
    if mt == "gemma4":                 # the multimodal checkpoint (text decoder under model.language_model.*)
        from miles.utils.tiny_gemma4 import build_tiny_gemma4

        text = real["text_config"]        # 26B-A4B: the MoE block (4 experts, top-2)
        return build_tiny_gemma4(out, seed=seed, final_logit_softcapping=float(
            text.get("final_logit_softcapping") or 0.0) or None, moe=bool(text.get("enable_moe_block")))
    if mt == "nemotron_h":             # hybrid Mamba-2 / attention / latent MoE: its own builder
        from miles.utils.tiny_nemotron import build_tiny_nemotron_model

        # every layer kind on each of 2 pipeline stages (M E * | - E M; the dense Nano: M * - | M * -); KV heads 1
        # where the real model has 2 so the replay's TP 2 replicates them as the recorded TP 4 does
        kv = int(real.get("num_key_value_heads") or 2)
        moe = "E" in real["hybrid_override_pattern"]
        return build_tiny_nemotron_model(out, pattern="ME*-EM" if moe else "M*-M*-", num_kv_heads=1 if kv <= 2 else 2,
                                         seed=seed, moe_latent_size=32 if real.get("moe_latent_size") else None,
                                         routed_scaling_factor=float(real.get("routed_scaling_factor", 1.0) or 1.0))
    if mt == "inkling_mm_model":       # Inkling: its text model in the text-only layout (inkling_text), which the
        #                                embedded engine serves (transformers' multimodal class needs scipy, not here)
        from miles.utils.tiny_inkling import build_tiny_inkling_model

        return build_tiny_inkling_model(out, seed=seed)
    if mt == "kimi_k25":               # the multimodal checkpoint (text model under language_model.model.*)
        from miles.utils.tiny_kimi_k25 import build_tiny_kimi_k25

        text = real["text_config"]           # its rope as it is (the recorded YaRN flags name it), sizes tiny
        rope = {k: v for k, v in (text.get("rope_scaling") or {}).items() if k != "type"}
        return build_tiny_kimi_k25(out, seed=seed, rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                                   rope_theta=float(text.get("rope_theta", 50000.0)),
                                   rope_scaling={"rope_type": "yarn", **rope} if rope else None,
                                   max_position_embeddings=int(text["max_position_embeddings"]))
    if "index_topk" in real:             # DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): MLA plus the indexer
        from miles.utils.tiny_dsa import build_tiny_dsa_model

        rope = real.get("rope_parameters") or real.get("rope_scaling") or {}
        yarn = rope.get("rope_type", rope.get("type")) == "yarn"     # its rope as it is (the recorded YaRN flags name it)
        scaling = {"rope_type": "yarn", **{k: v for k, v in rope.items() if k not in ("type", "rope_type",
                                                                                       "rope_theta")}}
        return build_tiny_dsa_model(out, model_type=mt, rms_norm_eps=float(real.get("rms_norm_eps", 1e-6)),
                                    rope_theta=float(rope.get("rope_theta", real.get("rope_theta", 10000.0))),
                                    n_group=2 if (real.get("n_group") or 1) > 1 else 1,
                                    rope_scaling=scaling if yarn else None,
                                    max_position_embeddings=int(real["max_position_embeddings"]) if yarn else 256,
                                    routed_scaling_factor=float(real.get("routed_scaling_factor", 1.0)), seed=seed)
    if mt == "glm4_moe":     # GLM-4.5 / 4.5-Air: their switches kept (q/k norms, biases, partial RoPE); 4 layers
        #                      (1 dense, 3 MoE) so that their PP 2 splits them evenly
        from miles.utils.tiny_glm4_moe import build_tiny_glm4_moe

        return build_tiny_glm4_moe(out, num_layers=4, use_qk_norm=bool(real.get("use_qk_norm")),
                                   attention_bias=bool(real.get("attention_bias")),
                                   partial_rotary_factor=float(real.get("partial_rotary_factor", 0.5)),
                                   rms_norm_eps=float(real.get("rms_norm_eps", 1e-5)),
                                   rope_theta=float(real.get("rope_theta", 10000.0)),
                                   first_k_dense_replace=1 if real.get("first_k_dense_replace") else 0,
                                   routed_scaling_factor=float(real.get("routed_scaling_factor", 1.0) or 1.0),
                                   n_group=2 if (real.get("n_group") or 1) > 1 else 1,
                                   mtp_layers=int(real.get("num_nextn_predict_layers", 0) or 0), seed=seed)
    if "kv_lora_rank" in real:
        from miles.utils.tiny_mla import build_tiny_mla_model

        rope = real.get("rope_parameters") or real.get("rope_scaling") or {}
        yarn = rope.get("rope_type", rope.get("type")) == "yarn"     # its rope as it is (the recorded YaRN flags name it)
        scaling = {"rope_type": "yarn", **{k: v for k, v in rope.items() if k not in ("type", "rope_type",
                                                                                       "rope_theta")}}
        return build_tiny_mla_model(out, model_type=mt, rms_norm_eps=float(real.get("rms_norm_eps", 1e-6)),
                                    rope_theta=float(rope.get("rope_theta", real.get("rope_theta", 10000.0))),
                                    q_lora_rank=24 if real.get("q_lora_rank") else None,
                                    n_group=2 if (real.get("n_group") or 1) > 1 else 1,
                                    routed_scaling_factor=float(real.get("routed_scaling_factor", 1.0) or 1.0),
                                    rope_scaling=scaling if yarn else None,
                                    **({"max_position_embeddings": int(real["max_position_embeddings"])} if yarn
                                       else {}),
                                    mtp_layers=int(real.get("num_nextn_predict_layers", 0) or 0), seed=seed)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.utils.tiny_model import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    ids = {"bos_token_id": None, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    tiny = shrink_config(real, len(tok), ids)
    tiny.pop("model_type")
    config = AutoConfig.for_model(mt, **tiny)
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    net.to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    return out


# ------------------------------------------------------------------------------------------- the scaler
# flag -> ModelShape field: the model-shape flags rewritten to the tiny model's value when the recorded command gives them
SHAPE_FIELDS = {
    "--num-layers": "num_layers", "--hidden-size": "hidden_size", "--ffn-hidden-size": "ffn_hidden_size",
    "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_query_groups",
    "--kv-channels": "kv_channels", "--vocab-size": "vocab_size",
    "--max-position-embeddings": "max_position_embeddings", "--rotary-base": "rotary_base",
    "--norm-epsilon": "norm_epsilon", "--num-experts": "num_experts", "--moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "--moe-router-topk": "moe_router_topk", "--moe-shared-expert-intermediate-size": "moe_shared_ffn_hidden_size",
    "--q-lora-rank": "q_lora_rank", "--kv-lora-rank": "kv_lora_rank", "--qk-head-dim": "qk_head_dim",
    "--qk-pos-emb-head-dim": "qk_pos_emb_head_dim", "--v-head-dim": "v_head_dim",
    "--moe-router-topk-scaling-factor": "moe_topk_scaling", "--moe-router-num-groups": "moe_num_groups",
    "--moe-router-group-topk": "moe_group_topk",
}
WORLD_FLAGS = ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine",
               "--num-gpus-per-node", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
               "--context-parallel-size", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
               "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
SIZE_FLAGS = ("--num-rollout", "--num-epoch", "--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size",
              "--micro-batch-size", "--over-sampling-batch-size", "--rollout-max-response-len",
              "--eval-max-response-len", "--n-samples-per-eval-prompt", "--moe-layer-freq")
PATH_FLAGS = ("--prompt-data", "--eval-prompt-data")
# the flags that need a GPU kernel package (miles/config/kernels.py: --moe-grouped-gemm, --moe-permute-fusion, DeepEP,
# ...): where the package does not import (a CPU box), the dry run refuses them by name, so the fixtures drop them
# there (``without_absent_kernel_flags``; the refusal itself: test_miles_scripts.py's test_kernel_flags_refused_here)
KERNEL_FLAGS = ("--moe-grouped-gemm", "--moe-permute-fusion", "--attention-backend", "--moe-enable-deepep",
                "--moe-token-dispatcher-type")
TOKEN_FLAGS = ("--rollout-stop-token-ids",)     # token ids of the real tokenizer: the tiny tokenizer's eos
# the reward where a random tiny policy would score every sample alike (a nonzero-std filter's script, the LoRA
# scripts), and a LoRA script's --save (added where absent: the test reads the saved adapters)
REWARD_FLAGS = ("--rm-type", "--custom-rm-path", "--save")
SCALED_FLAGS = (*SHAPE_FIELDS, *WORLD_FLAGS, *SIZE_FLAGS, *PATH_FLAGS, *KERNEL_FLAGS, *TOKEN_FLAGS, *REWARD_FLAGS)
MAX_RANKS = 4


REPLAY_ALL = os.environ.get("MILES_REPLAY_ALL") == "1"


def replay_params(names, in_make_test: tuple[str, ...]) -> list:
    """``names`` as pytest params of a replay test: those not in ``in_make_test`` run only under ``make test-replay``
    (MILES_REPLAY_ALL=1), as the replay tier's own fixtures beyond its ``make test`` subset."""
    return tier_params({n: (n,) for n in names}, in_make_test)


def tier_params(cases: dict[str, tuple], in_make_test: tuple[str, ...]) -> list:
    """``cases`` (id -> the parametrization's values) as pytest params marked ``replay`` (``make test-replay``'s
    ``-m replay`` selects them): those not in ``in_make_test`` are skipped unless MILES_REPLAY_ALL=1, so ``make test``
    runs one representative of a family's matrix (weight-sync modes, layouts) and ``make test-replay`` all of it
    (docs/benchmarks.md, "The CPU suite": which ones, and why each is covered in ``make test`` by another)."""
    import pytest

    unknown = set(in_make_test) - set(cases)
    assert not unknown, f"in_make_test names no case: {sorted(unknown)}"
    skip = pytest.mark.skip(reason="the whole replay tier runs under `make test-replay` (MILES_REPLAY_ALL=1)")
    return [pytest.param(*values, id=name,
                         marks=(pytest.mark.replay,) + (() if REPLAY_ALL or name in in_make_test else (skip,)))
            for name, values in cases.items()]


@dataclass
class Replay:
    """A recorded command at tiny CPU scale: ``nproc`` torchrun ranks running ``entry`` with ``argv``."""

    name: str
    entry: str
    nproc: int
    argv: list[str]
    engines: bool
    changed: dict[str, str] = field(default_factory=dict)   # flag -> "recorded -> tiny"


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """flag -> its values (the flag's last occurrence)."""
    out: dict[str, list[str]] = {}
    cur = None
    for t in argv:
        if t.startswith("--"):
            cur = t
            out[cur] = []
        elif cur is not None:
            out[cur].append(t)
    return out


def _set(argv: list[str], flag: str, *values: str) -> list[str]:
    """``argv`` with ``flag``'s values replaced (appended when absent)."""
    out, i, done = [], 0, False
    while i < len(argv):
        t = argv[i]
        if t == flag:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            if not done:
                out += [flag, *values]
                done = True
            continue
        out.append(t)
        i += 1
    return out if done else out + [flag, *values]


def _drop(argv: list[str], flag: str) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        out.append(argv[i])
        i += 1
    return out


def without_absent_kernel_flags(argv: list[str], changed: dict[str, str] | None = None) -> list[str]:
    """``argv`` without the flags whose GPU kernel package does not import here, or whose kernels are not wired
    (``miles.config.kernels``): a switch is dropped, a value (``--attention-backend fused``,
    ``--moe-token-dispatcher-type flex``, ``--dsa-attention-backend tilelang``) becomes the one that needs no package
    (auto, alltoall, megatron). Each change is entered in ``changed``."""
    from miles.config.kernels import KERNEL_FLAGS as ROWS
    from miles.config.kernels import importable

    instead = {"--attention-backend": "auto", "--moe-token-dispatcher-type": "alltoall",
               "--dsa-attention-backend": "megatron"}
    flags = _flags(argv)
    for row in ROWS:
        name, _, value = row.flag.partition(" ")
        if name not in flags or (value and flags[name] != [value]) or (importable(row.module) and not row.unwired):
            continue
        if value:
            argv = _set(argv, name, instead[name])
            after = instead[name]
        else:
            argv = _drop(argv, name)
            after = "(dropped)"
        if changed is not None:
            why = "its kernels are not wired here" if row.unwired else "absent here"
            changed[name] = f"{' '.join(flags[name]) or '(given)'} -> {after}: needs {row.package}, {why}"
    return argv


def _int(flags: dict[str, list[str]], name: str, default: int) -> int:
    v = flags.get(name)
    return int(v[0]) if v else default


def _fmt(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


VARYING_REWARD = "miles_fixtures.varying_reward"   # the LoRA replays' reward (tiny_replay); tests/ on PYTHONPATH


async def varying_reward(args, sample) -> float:
    """A reward in [0, 1) from a hash of the sample's tokens: two different samples of a group get different
    rewards, so GRPO's advantages (and the gradient) are not 0 on a random tiny policy."""
    digest = hashlib.sha256(str(list(sample.tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


HALVING_ORDER = ("--context-parallel-size", "--pipeline-model-parallel-size", "--tensor-model-parallel-size")


def halving_order(path: Path) -> tuple[str, ...]:
    """The order in which the replay of fixture ``path`` halves its parallel sizes while its trainer ranks pass the
    CPU world's budget: ``HALVING_ORDER``, the size its ``# replay-keep: FLAG`` header names (what its replay is
    for, e.g. DeepSeek-V3.2's DSA under PP) moved last."""
    keep = (fixture_header(path, "replay-keep") or "").split(" ", 1)[0]
    if keep and keep not in HALVING_ORDER:
        raise ValueError(f"{path.name}: # replay-keep: {keep!r} is none of {', '.join(HALVING_ORDER)}")
    return tuple(f for f in HALVING_ORDER if f != keep) + ((keep,) if keep else ())


def tiny_replay(path: Path, workdir: Path, models: Path, skills_url: str | None = None) -> Replay:
    """The fixture at ``path`` at tiny CPU scale (see the module docstring); the tiny model is built under
    ``models`` (once per family), the data, files and outputs go to ``workdir/<fixture name>``; ``skills_url``: the
    evaluation server of the eval delegate scripts (``skills_stand_in``)."""

    from miles.trainer.megatron.model import ModelShape

    entry, expect, lines = read_fixture(path)
    name = fixture_model(path)
    model = build_family_model(models / (name or "tiny-qwen3"), name)
    out = write_replay_workdir(workdir / path.stem, skills_url)  # its own data, files and --save / --load directory
    data = out / fixture_data(path)
    argv = fixture_argv(lines, {"MODEL": str(model), "DATA": str(data), "OUT": str(out)})
    flags = _flags(argv)
    changed: dict[str, str] = {}

    def put(flag: str, *values: str) -> None:
        nonlocal argv
        before = " ".join(flags.get(flag, ["(absent)"])) or "(given)"
        after = " ".join(values)
        if before != after:
            changed[flag] = f"{before} -> {after}"
        argv = _set(argv, flag, *values)

    # model shape: the tiny model's (config.json, as the Megatron backend reads it)
    from miles.utils.model_dir import load_config

    shape = ModelShape.from_hf_config(load_config(model))       # an aliased model type registered (hf_aliases)
    for flag, attr in SHAPE_FIELDS.items():
        if flag in flags:        # ungrouped routing (ModelShape's 0 groups) is Megatron's 1 group of 1
            put(flag, _fmt(getattr(shape, attr) or (1 if attr in ("moe_num_groups", "moe_group_topk") else 0)))
    if "--moe-layer-freq" in flags:
        put("--moe-layer-freq", "[" + ",".join(str(v) for v in shape.moe_layer_pattern) + "]")
    if "--rollout-stop-token-ids" in flags:    # the real tokenizer's ids (GLM-4.5's eos, <|user|>, <|observation|>)
        put("--rollout-stop-token-ids", str(load_config(model).eos_token_id))     # -> the tiny tokenizer's eos
    if "--moe-latent-size" in flags:     # Nemotron-H's latent MoE (config.json's moe_latent_size)
        put("--moe-latent-size", str(getattr(shape.variant, "latent_size", 0)))

    # world: parallel sizes at most 2 each, trainer ranks their product (at least 2 when the script has several)
    train_only = "--debug-train-only" in flags
    colocate = "--colocate" in flags
    sizes = {f: min(_int(flags, f, 1), 2) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                                    "--context-parallel-size")}
    ep = min(_int(flags, "--expert-model-parallel-size", 1), 2)
    recorded_trainers = _int(flags, "--actor-num-nodes", 1) * _int(flags, "--actor-num-gpus-per-node", 1)
    engine_ranks = 0 if train_only or colocate else min(_int(flags, "--rollout-num-gpus", 1), 2)
    budget = MAX_RANKS - engine_ranks if colocate or train_only else 2
    for f in halving_order(path):
        while sizes["--tensor-model-parallel-size"] * sizes["--pipeline-model-parallel-size"] * \
                sizes["--context-parallel-size"] > budget and sizes[f] > 1:
            sizes[f] //= 2
    model_parallel = sizes["--tensor-model-parallel-size"] * sizes["--pipeline-model-parallel-size"] * \
        sizes["--context-parallel-size"]
    trainers = max(model_parallel, min(recorded_trainers, 2), ep if ep <= budget else 1)
    for f, v in sizes.items():
        if f in flags:
            put(f, str(v))
    if "--expert-model-parallel-size" in flags:
        stage = trainers // sizes["--pipeline-model-parallel-size"]     # EP splits a pipeline stage's ranks
        put("--expert-model-parallel-size", str(ep if stage % ep == 0 else 1))
    if "--expert-tensor-parallel-size" in flags:
        put("--expert-tensor-parallel-size", "1")
    pp, layers = sizes["--pipeline-model-parallel-size"], shape.num_layers
    split = [f for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers") if f in flags]
    for i, f in enumerate(split):
        if i == 0 and pp > 1 and layers % pp:    # the real model's uneven split at the tiny model's size: this end
            put(f, str(layers - -(-layers // pp) * (pp - 1)))   # stage a layer less (3 layers at PP 2: 2 + 1)
            continue
        argv = _drop(argv, f)       # the tiny model's layers split evenly over its stages (or its other end stage's)
        changed[f] = f"{flags[f][0]} -> (dropped: the tiny model's {layers} layers split evenly)"
    world = trainers + engine_ranks
    put("--actor-num-nodes", "1")
    put("--actor-num-gpus-per-node", str(trainers))
    if "--rollout-num-gpus" in flags:
        put("--rollout-num-gpus", str(trainers if colocate else engine_ranks))
    if "--rollout-num-gpus-per-engine" in flags:   # the CPU world's engines are embedded ones: one device each
        put("--rollout-num-gpus-per-engine", "1")
    if "--num-gpus-per-node" in flags:
        put("--num-gpus-per-node", str(world))

    # sizes: 2 rollouts of 2 prompts, at most 2 samples each, 8 tokens of response
    n = min(_int(flags, "--n-samples-per-prompt", 1), 2)
    batch = max(2, trainers)   # the driver hands each trainer rank (TP and CP ranks too) whole groups of its own
    argv = _drop(argv, "--num-epoch")
    if "--num-epoch" in flags:
        changed["--num-epoch"] = f"{flags['--num-epoch'][0]} -> (dropped for --num-rollout 2)"
    put("--num-rollout", "2")
    put("--rollout-batch-size", str(batch))
    if "--n-samples-per-prompt" in flags:
        put("--n-samples-per-prompt", str(n))
    steps = _int(flags, "--num-steps-per-rollout", 1)
    if "--global-batch-size" in flags:
        put("--global-batch-size", str(max(batch * n // steps, 1)))
    if "--micro-batch-size" in flags:
        put("--micro-batch-size", "1")
    if "--over-sampling-batch-size" in flags:
        put("--over-sampling-batch-size", str(batch))
    for f, v in (("--rollout-max-response-len", "8"), ("--eval-max-response-len", "8"),
                 ("--n-samples-per-eval-prompt", "1")):
        if f in flags:
            put(f, v)

    # reward: a random tiny policy solves no prompt, so a recorded check_reward_nonzero_std filter would keep no group;
    # 0/1 rewards drawn per sample let a group's rewards differ (the filter kept as recorded)
    if "--rm-type" in flags and any(v.endswith(".check_reward_nonzero_std")
                                    for v in flags.get("--dynamic-sampling-filter-path", [])):
        put("--rm-type", "deterministic_random")
    # LoRA: the recorded reward (math, deepscaler) is 0 on every sample of the random tiny policy, so every advantage
    # and the gradient would be 0 and a broken adapter backward would pass; a reward in [0, 1) from a hash of each
    # sample differs between a group's samples, so the test can check the adapters train (grad norm > 0, lora_B
    # moved off its zero init in the saved adapters: --save added where the command has none)
    elif "--lora-rank" in flags and "--rm-type" in flags and "--custom-rm-path" not in flags:
        put("--custom-rm-path", VARYING_REWARD)
    if "--lora-rank" in flags and "--save" not in flags:
        put("--save", str(out / "lora_replay_save"))
    # a fixture's ``# replay-add: --flag ...`` header: value-less flags the replay adds, where the recorded command
    # relies on Miles doing it unasked (its engines serve a LoRA run's adapter: --sglang-enable-lora here)
    for flag in (fixture_header(path, "replay-add") or "").split(" (", 1)[0].split():   # "(why)" after the flags
        if not flag.startswith("--"):
            raise ValueError(f"{path.name}: # replay-add: {flag!r} is no --flag")
        if flag not in flags:
            changed[flag] = "(absent) -> (given)"
            argv = argv + [flag]

    # data: 2 prompts for each evaluation set
    if "--eval-prompt-data" in flags:
        vals = flags["--eval-prompt-data"]
        small = out / ("eval_" + data.name)
        if len(vals) == 1:                      # a file alone (Miles names it after the file)
            put("--eval-prompt-data", str(small))
        else:                                   # NAME FILE pairs
            put("--eval-prompt-data", *[v for i in range(0, len(vals) - 1, 2) for v in (vals[i], str(small))])
    if "--prompt-data" in flags:
        changed["--prompt-data"] = f"(recorded dataset) -> {data.name}"

    argv = without_absent_kernel_flags(argv, changed)
    if not train_only:
        argv = _drop_sglang_only(argv, changed, entry)
        argv = argv + ["--check-weight-update-equal"]
    argv += ["--output-dir", str(out / "run")]
    return Replay(path.stem, entry, world, argv, engines=not train_only, changed=changed)


def _drop_sglang_only(argv: list[str], changed: dict[str, str], entry: str) -> list[str]:
    """``argv`` without the --sglang-* flags the embedded engine refuses (the CPU world's engines are embedded ones;
    on a GPU with SGLang, --rollout-engine auto starts SGLang, which takes them)."""
    from miles.config import ConfigError, parse_args
    from miles.config.sglang import check_embedded_engine

    while True:
        try:        # a flag that needs a dropped one (--sglang-dp-size without --sglang-enable-dp-attention) goes too
            cfg = parse_args(argv, is_async=entry == "train_async.py")
            check_embedded_engine(cfg.sglang, why="the CPU world's engines")
            return argv
        except ConfigError as e:
            flag = str(e).split(" ", 1)[0].rstrip(":")
            if not flag.startswith("--sglang-") or flag not in argv:
                raise
            changed[flag] = "(given) -> (dropped: SGLang-only, the CPU world's engines are embedded ones)"
            argv = _drop(argv, flag)


def write_replay_workdir(out: Path, skills_url: str | None = None) -> Path:
    """``write_workdir`` plus the 2-prompt evaluation sets the replays use."""
    write_workdir(out, skills_url=skills_url)
    for name in ("data.jsonl", "geo.jsonl", "lean.jsonl"):
        rows = (out / name).read_text().splitlines()[:2]
        (out / f"eval_{name}").write_text("\n".join(rows) + "\n")
    yaml = out / "eval_delegate_multi_tasks.yaml"  # its datasets at tiny scale too: 2 prompts, 8 response tokens
    yaml.write_text(yaml.read_text().replace(str(out / "data.jsonl"), str(out / "eval_data.jsonl"))
                    .replace("    max_response_len: 24576\n", "    max_response_len: 8\n"))
    yaml = out / "multi_task.yaml"  # the same, and at most 2 samples per eval prompt
    yaml.write_text(yaml.read_text().replace(str(out / "data.jsonl"), str(out / "eval_data.jsonl"))
                    .replace("    max_response_len: 16384\n", "    max_response_len: 8\n")
                    .replace("n_samples_per_eval_prompt: 16\n", "n_samples_per_eval_prompt: 2\n"))
    (out / "eval_dapo_heldout.yaml").write_text(dapo_heldout_yaml(out / "eval_data.jsonl", max_response_len=8))
    return out


@contextlib.contextmanager
def _serving(handler: type) -> Iterator[str]:
    """``handler`` served on a free local port in a daemon thread; yields the base URL, shuts down on exit."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def skills_stand_in() -> Iterator[str]:
    """A local stand-in for the evaluation server Miles's eval delegate scripts post to (``skills_server:9050`` in
    its multi_tasks.yaml, NeMo-Skills there): every POST is answered with one accuracy per benchmark it names.
    Yields its URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            names = [b.get("name", str(b)) if isinstance(b, dict) else str(b) for b in body.get("benchmarks") or []]
            answer = json.dumps({name: {"accuracy": 0.0} for name in names}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass

    with _serving(Handler) as url:
        yield url + "/evaluate"


# the proofs the Lean stand-in accepts: a closed natural-number sum, closed by a decision tactic
_LEAN_THEOREM = re.compile(r"theorem\s+\S+\s*:\s*\((\d+)\s*:\s*ℕ\)\s*\+\s*(\d+)\s*=\s*(\d+)\s*:=\s*by\s+"
                           r"(norm_num|decide|rfl|simp|omega)\s*$")


def lean_check(code: str) -> dict:
    """The Lean stand-in's answer for one snippet, in the Lean REPL's response form (kimina's ``response``): a
    ``sorry`` gives a warning and a ``sorries`` entry; a theorem ``(a : ℕ) + b = c`` closed by ``norm_num``,
    ``decide``, ``rfl``, ``simp`` or ``omega`` is accepted when a + b = c (no messages); anything else is an error
    message (the stand-in checks nothing else: it is no Lean)."""
    pos = {"line": 1, "column": 0}
    if re.search(r"\bsorry\b", code):
        return {"env": 0, "messages": [{"severity": "warning", "pos": pos, "endPos": pos,
                                        "data": "declaration uses 'sorry'"}],
                "sorries": [{"pos": pos, "endPos": pos, "goal": "⊢ (stand-in)"}]}
    m = _LEAN_THEOREM.search(code.strip())
    if m and int(m.group(1)) + int(m.group(2)) == int(m.group(3)):
        return {"env": 0}
    why = "the equation does not hold" if m else "not a proof the stand-in can check"
    return {"env": 0, "messages": [{"severity": "error", "pos": pos, "endPos": pos, "data": f"stand-in: {why}"}]}


@contextlib.contextmanager
def lean_stand_in() -> Iterator[str]:
    """A local stand-in for the kimina Lean server (``projectnumina/kimina-lean-server``, which Miles's formal-math
    reward starts in docker): ``GET /health``, and ``POST /api/check`` with ``{"snippets": [{"id", "code"}], "timeout",
    ...}`` answered ``{"results": [{"id", "time", "error": None, "response": ...}]}`` per snippet (``lean_check``).
    Yields its base URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(200, {"status": "ok"}) if self.path == "/health" else self._answer(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/api/check":
                self._answer(404, {"detail": "Not Found"})
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            snippets = body.get("snippets") or []
            if not snippets:
                self._answer(422, {"detail": "`snippets` must be non empty"})
                return
            self._answer(200, {"results": [{"id": s["id"], "time": 0.0, "error": None, "response": lean_check(s["code"])}
                                           for s in snippets]})

        def log_message(self, *args) -> None:
            pass

    with _serving(Handler) as url:
        yield url


# the flags naming the OPD teacher servers Miles's scripts start before train.py (SGLang on the teacher model at
# http://127.0.0.1:13141, :13142); each recorded address gets an embedded engine on a free port
TEACHER_FLAGS = ("--rm-url", "--opd-teacher-urls")
_LOCAL_SERVER = re.compile(r"http://127\.0\.0\.1:\d+")


def recorded_teachers(argv: list[str]) -> list[str]:
    """The distinct local server addresses (``http://127.0.0.1:PORT``) the teacher flags of ``argv`` name."""
    flags = _flags(argv)
    return sorted({m.group(0) for f in TEACHER_FLAGS for v in flags.get(f, []) for m in _LOCAL_SERVER.finditer(v)})


@contextlib.contextmanager
def teacher_stand_ins(replay: Replay, path: Path, models: Path, logdir: Path,
                      timeout: float = 300.0) -> Iterator[list[str]]:
    """Stand-ins for the teacher servers the replay of fixture ``path`` names (``TEACHER_FLAGS``): one embedded
    engine (``python -m miles.engine`` on CPU, under the real supervisor) per recorded address, serving a tiny model
    of the fixture's family with other random weights than the student's (built under ``models``; the same tiny
    tokenizer), each on a free port. The recorded addresses in ``replay.argv`` are rewritten to them and each rewrite is entered
    in ``replay.changed``. Yields the stand-ins' URLs (none: nothing started); they stop on exit."""
    import asyncio

    from embedded_engines import start_engine, wait_engines

    recorded = recorded_teachers(replay.argv)
    if not recorded:
        yield []
        return
    flags = _flags(replay.argv)
    name = fixture_model(path)
    model = build_family_model(models / f"{name or 'tiny-qwen3'}-teacher", name, seed=1)
    started = []
    try:
        for i, _ in enumerate(recorded):
            started.append(start_engine(model, logdir / f"teacher{i}.log", None, name=f"teacher{i}"))
        asyncio.run(asyncio.wait_for(wait_engines([(url, sup) for sup, url in started], timeout), timeout + 10))
        local = {rec: url for rec, (_, url) in zip(recorded, started)}
        for flag in TEACHER_FLAGS:
            if flag not in flags:
                continue
            values = [_LOCAL_SERVER.sub(lambda m: local[m.group(0)], v) for v in flags[flag]]
            replay.argv = _set(replay.argv, flag, *values)
            replay.changed[flag] = (f"{' '.join(flags[flag])} -> {' '.join(values)} (teacher stand-in: an embedded "
                                    "engine on the tiny model)")
        yield [url for _, url in started]
    finally:
        for sup, _ in started:
            sup.stop()
