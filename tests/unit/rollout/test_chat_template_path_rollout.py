"""``--chat-template-path`` reaches every place the run templates: the driver's one tokenizer (``miles.run.build``)
renders ``--prompt-data`` and the evaluation data with the file's template, the SFT rollout's loss masks follow it,
the plugins' args carry ``chat_template_path`` (Miles's multi-agent example loads its tokenizer with it), and the
rollout manager sends the engine the ids of the prompt the file renders (the last test, against a real embedded
engine). The template is distinctive: ``##USER## ...`` turns and ``[[BOT]] ... [[/BOT]]`` replies, where the tiny
model's own is ChatML (``<|im_start|>user ...``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.config import parse_args

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}[[BOT]] {{ m['content'] }} [[/BOT]]\n"
            "{% else %}##{{ m['role'] | upper }}## {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}[[BOT]] {% endif %}")


def rendered(question: str) -> str:
    return f"##USER## {question}\n[[BOT]] "


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"input": [{"role": "user", "content": f"{i}+1="}], "label": str(i + 1)})
                             + "\n" for i in range(4)))
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps({"input": [{"role": "user", "content": "9+9="}], "label": "18"}) + "\n")
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+2="},
                                                    {"role": "assistant", "content": str(i + 2)}]}) + "\n"
                           for i in range(2)))
    return {"template": template, "train": train, "eval": ev, "sft": sft, "tmp": tmp_path}


def _ctx(*, engines: bool) -> SimpleNamespace:
    """What ``miles.run.build._driver_plan`` reads of the SPMD context: the engines' presence and the world."""
    world = SimpleNamespace(device=SimpleNamespace(type="cpu"), num_nodes=1, world_size=2 if engines else 1)
    return SimpleNamespace(plan=SimpleNamespace(engines=[object()] if engines else []), world=world)


def _rl_cfg(files: dict[str, Path], model: Path, *extra: str):
    return parse_args(["--train-backend", "fsdp", "--hf-checkpoint", str(model), "--prompt-data", str(files["train"]),
                       "--input-key", "input", "--label-key", "label", "--rm-type", "math", "--apply-chat-template",
                       "--eval-prompt-data", "ev", str(files["eval"]), "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
                       "--output-dir", str(files["tmp"] / "out"), *extra])


def test_the_driver_renders_train_and_eval_prompts_with_the_file(files, tiny_model_dir):
    from miles.run.build import _driver_plan

    cfg = _rl_cfg(files, tiny_model_dir, "--chat-template-path", str(files["template"]))
    _, local = _driver_plan(cfg, _ctx(engines=True))
    tok = local["tokenizer"]
    assert tok.chat_template == TEMPLATE
    items = local["data_source"].dataset.items
    assert [tok.decode(it.prompt_ids) for it in items] == [rendered(f"{i}+1=") for i in range(4)]
    assert [tok.decode(it.prompt_ids) for it in local["eval_datasets"]["ev"].items] == [rendered("9+9=")]

    plain = _rl_cfg(files, tiny_model_dir)   # without the flag: the checkpoint's own (ChatML) template, as before
    _, local = _driver_plan(plain, _ctx(engines=True))
    assert local["tokenizer"].decode(local["data_source"].dataset.items[0].prompt_ids) == (
        "<|im_start|>user\n0+1=<|im_end|>\n<|im_start|>assistant\n")


def test_the_sft_rollouts_loss_mask_follows_the_file(files, tiny_model_dir):
    """Miles's SFT rollout (--rollout-function-path miles.rollout.sft_rollout.generate_rollout) over the driver's data
    source and tokenizer, as miles.run.build wires it: the trained tokens are what the file's template adds for the
    assistant turn after its generation prompt."""
    from miles.rollout.rollout_fn import build_rollout_function
    from miles.run.build import _driver_plan

    def run(*extra: str):
        cfg = parse_args(["--train-backend", "fsdp", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data",
                          str(files["sft"]), "--input-key", "messages", "--rollout-function-path",
                          "miles.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
                          "--disable-compute-advantages-and-returns", "--debug-train-only", "--num-rollout", "1",
                          "--rollout-batch-size", "2", "--global-batch-size", "2", "--output-dir",
                          str(files["tmp"] / "out"), *extra])
        _, local = _driver_plan(cfg, _ctx(engines=False))
        fn = build_rollout_function(cfg, local["data_source"], local["tokenizer"])
        groups, _ = asyncio.run(fn.next_rollout(0))
        return local["tokenizer"], [s for g in groups for s in g]

    tok, samples = run("--chat-template-path", str(files["template"]))
    for i, s in enumerate(samples):
        prompt, trained = tok.decode(s.tokens[:-s.response_length]), tok.decode(s.tokens[-s.response_length:])
        assert (prompt, trained) == (rendered(f"{i}+2="), f"{i + 2} [[/BOT]]\n")
        assert s.loss_mask == [1] * s.response_length
    tok, samples = run()
    assert tok.decode(samples[0].tokens[-samples[0].response_length:]) == "2<|im_end|>\n"  # the ChatML default


def test_plugins_args_carry_chat_template_path(files, tiny_model_dir, monkeypatch):
    """The args a Miles plugin is given (custom rollout function, rollout manager) have ``chat_template_path``, and
    Miles's processing_utils.load_tokenizer with it (as Miles's multi-agent example calls it) gives the file's
    template; without the flag the field is there and None."""
    from miles.rollout.data import DataSource
    from miles.rollout.manager import RolloutManager
    from miles.rollout.rollout_fn import build_prompt_dataset, build_rollout_function
    from miles.utils.mask_utils import MultiTurnLossMaskGenerator
    from miles.utils.processing_utils import load_tokenizer

    (files["tmp"] / "ctp_plugin.py").write_text("def rollout(args, rollout_id, data_source, evaluation=False):\n"
                                                "    return []\n")
    monkeypatch.syspath_prepend(str(files["tmp"]))
    for extra, want in (([], None), (["--chat-template-path", str(files["template"])], str(files["template"]))):
        cfg = _rl_cfg(files, tiny_model_dir, "--rollout-function-path", "ctp_plugin.rollout", *extra)
        tok = load_tokenizer(str(tiny_model_dir), chat_template_path=cfg.data.chat_template_path)
        source = DataSource(build_prompt_dataset(cfg.data, tok, 0))
        assert build_rollout_function(cfg, source, tok).args.chat_template_path == want
        mgr = RolloutManager(cfg.rollout, cfg.data, cfg.reward, None, tok, source, eval_cfg=cfg.eval)
        assert mgr.args.chat_template_path == want
    plugin_tok = load_tokenizer(str(tiny_model_dir), chat_template_path=mgr.args.chat_template_path)
    ids, mask = MultiTurnLossMaskGenerator(plugin_tok, "qwen3").get_loss_mask(
        [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}])
    assert plugin_tok.decode([t for t, m in zip(ids, mask) if m]) == "2 [[/BOT]]\n"


@pytest.mark.multiprocess
def test_the_manager_sends_the_engine_the_files_prompt(files, tiny_model_dir):
    """A real embedded engine: the ids of each request are the tokens of the prompt the file renders."""
    from miles.engine.testing import EngineProc
    from miles.fleet.client import EngineClient
    from miles.rollout.manager import RolloutManager
    from miles.run.build import _driver_plan

    class Recording(EngineClient):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.sent: list[list[int]] = []

        async def generate(self, input_ids, sampling_params, **kw):
            self.sent.append(list(input_ids))
            return await super().generate(input_ids, sampling_params, **kw)

    cfg = _rl_cfg(files, tiny_model_dir, "--chat-template-path", str(files["template"]),
                  "--rollout-max-response-len", "2")
    _, local = _driver_plan(cfg, _ctx(engines=True))
    tok = local["tokenizer"]
    eng = EngineProc(tiny_model_dir, "--max-running-requests", "2", log=files["tmp"] / "engine.log")
    try:
        async def go():
            async with Recording(eng.url, timeout=60, max_retries=1, concurrency=4) as client:
                mgr = RolloutManager(cfg.rollout, cfg.data, cfg.reward, client, tok, local["data_source"],
                                     eval_cfg=cfg.eval)
                res = await mgr.generate_rollout(0)
                return client.sent, res
        sent, res = asyncio.run(asyncio.wait_for(go(), 180))
    finally:
        eng.stop()
    assert sorted(tok.decode(ids) for ids in sent) == [rendered("0+1="), rendered("1+1=")]
    assert sorted(tok.decode(s.tokens[:-s.response_length]) for g in res.samples for s in g) == sorted(
        tok.decode(ids) for ids in sent)
