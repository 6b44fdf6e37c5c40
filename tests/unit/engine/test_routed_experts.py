"""SGLang's ``return_routed_experts`` on the embedded engine (R3): every token that ran through the model
reports the top-k experts of each MoE layer, equal to HF's own router on the same tokens."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.engine.engine import Engine, EngineArgs
from miles.engine.protocol import BadRequest, GenerateReqInput
from miles.engine.routed_experts import RoutedExpertsRecorder, decode
from miles.engine.testing import build_engine_model
from miles.utils.tiny_model import build_tiny_moe_model

LAYERS, TOPK = 3, 2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_tiny_moe_model(tmp_path_factory.mktemp("moe"), num_layers=LAYERS, num_experts=8,
                                num_experts_per_tok=TOPK, mlp_only_layers=(1,))


def _engine(model, **kw) -> Engine:
    eng = Engine(EngineArgs(hf_checkpoint=str(model), max_context_len=96, max_running_requests=2, random_seed=0, **kw))
    eng.start()
    return eng


def _run(eng: Engine, bodies: list[dict]) -> list[dict]:
    async def one(b):
        specs, _ = eng.prepare(GenerateReqInput(**b))
        return await asyncio.wait_for(eng.wait_final(eng.submit(specs, stream=False)), 120)

    async def go():
        return [o for res in await asyncio.gather(*[one(b) for b in bodies]) for o in res]
    return asyncio.run(go())


def _hf_routing(model_dir, tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rec = RoutedExpertsRecorder(model, model.config)
    rec.begin()
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    return rec.end(len(tokens)).numpy()


IDS = torch.tensor([[5, 9, 13, 2, 7, 30, 41, 8, 11]])


def _record_routers(model, config, pick) -> tuple[RoutedExpertsRecorder, torch.Tensor, dict[int, torch.Tensor]]:
    """The recorder of ``model`` (``config``: its text model's), the rows it records over one forward of ``IDS``, and
    per router layer ``pick(output)`` of what that router returned in the same forward."""
    rec = RoutedExpertsRecorder(model, config)
    seen: dict[int, torch.Tensor] = {}
    for layer, mod in rec.routers:
        mod.register_forward_hook(lambda _m, _i, out, layer=layer: seen.__setitem__(layer, pick(out)))
    rec.begin()
    with torch.no_grad():
        model(input_ids=IDS)
    return rec, rec.end(IDS.shape[1]), seen


def test_engine_returns_the_routers_top_k_for_every_token(moe_model):
    prompts = [[5, 9, 13, 2, 7, 30], [40, 41, 8], [11, 12, 13, 14, 15, 16, 17, 18]]
    bodies = [{"input_ids": p, "return_logprob": True, "return_routed_experts": True,
               "sampling_params": {"max_new_tokens": 6 + 3 * i, "temperature": 1.0, "sampling_seed": i, "n": 2,
                                   "ignore_eos": True}} for i, p in enumerate(prompts)]
    eng = _engine(moe_model)  # 2 running requests at most: slots are refilled and moved, n=2 shares the prompt
    try:
        outs = _run(eng, bodies)
        start = _run(eng, [{**bodies[0], "routed_experts_start_len": 4, "sampling_params": {
            "max_new_tokens": 5, "temperature": 0}}])[0]
        plain = _run(eng, [{"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}}])[0]
    finally:
        eng.stop()
    assert "routed_experts" not in plain["meta_info"]
    for i, o in enumerate(outs):
        tokens = prompts[i // 2] + o["output_ids"]
        got = decode(o["meta_info"]["routed_experts"], LAYERS, TOPK)
        assert got.shape == (len(tokens) - 1, LAYERS, TOPK)
        ref = _hf_routing(moe_model, tokens[:-1])
        # the same experts (top-k order may differ only between exactly tied scores, absent here)
        np.testing.assert_array_equal(got[:, [0, 2]], ref[:, [0, 2]])
        assert (got[:, 1] == 0).all()  # a dense layer (mlp_only_layers) reports zeros, as SGLang's buffer
        assert len(set(map(tuple, got[:, 0].tolist()))) > 1  # the routing varies over tokens
    tokens = prompts[0] + start["output_ids"]
    got = decode(start["meta_info"]["routed_experts"], LAYERS, TOPK)
    np.testing.assert_array_equal(got, _hf_routing(moe_model, tokens[:-1])[4:])


def test_glm47_flash_grouped_sigmoid_router_is_recorded(tmp_path):
    """GLM-4.7-Flash's router (sigmoid scores + correction bias, group-limited top-k) returns its chosen indices too:
    the engine reports them (Miles's GLM-4.7-Flash command passes --use-rollout-routing-replay), a dense first layer
    as zeros."""
    from miles.utils.tiny_mla import build_tiny_mla_model

    model = build_tiny_mla_model(tmp_path / "glm", num_layers=3, n_routed_experts=4, num_experts_per_tok=2,
                                 first_k_dense_replace=1, n_group=2, topk_group=1)
    with torch.no_grad():   # a router drawn at random: routing differs between tokens
        from safetensors.torch import load_file, save_file
        files = list((tmp_path / "glm").glob("*.safetensors"))
        for f in files:
            sd = load_file(str(f))
            for k in sd:
                if k.endswith("mlp.gate.weight"):
                    sd[k] = torch.randn(sd[k].shape, generator=torch.Generator().manual_seed(1)) * 0.5
            save_file(sd, str(f), metadata={"format": "pt"})
    prompt = [5, 9, 13, 2, 7, 30, 41, 8]
    eng = _engine(model)
    try:
        out = _run(eng, [{"input_ids": prompt, "return_routed_experts": True,
                          "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}])[0]
    finally:
        eng.stop()
    tokens = prompt + out["output_ids"]
    got = decode(out["meta_info"]["routed_experts"], 3, 2)
    ref = _hf_routing(model, tokens[:-1])
    assert got.shape == ref.shape == (len(tokens) - 1, 3, 2)
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(ref, -1))
    assert (got[:, 0] == 0).all() and len(set(map(tuple, got[:, 1].tolist()))) > 1


def test_a_dense_model_refuses_return_routed_experts(tmp_path):
    eng = _engine(build_engine_model(tmp_path / "dense"))
    try:
        with pytest.raises(BadRequest, match="return_routed_experts: the embedded engine records routed experts for Qwen3-MoE, GLM-4.7-Flash, DeepSeek-V3, Kimi-K2, JoyAI-LLM-Flash, "
                           "Gemma 4 MoE, Qwen3-Next, Qwen3.5-MoE, Nemotron-H \\(Nemotron-3\\), GLM-4.5, gpt-oss, DeepSeek-V3.2, "
                           "GLM-5, DeepSeek-V4 models, not this 'qwen3'"):
            _run(eng, [{"input_ids": [1, 2, 3], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}}])
    finally:
        eng.stop()


def test_gemma4_moe_routers_are_recorded(tmp_path):
    """Gemma 4's routers (``layers.L.router`` of the multimodal model's text decoder, returning (probabilities,
    weights, indices)) are recorded: each layer's row is the top-k of its router's probabilities."""
    from transformers import AutoModelForImageTextToText

    from miles.utils.tiny_gemma4 import build_tiny_gemma4

    model = AutoModelForImageTextToText.from_pretrained(build_tiny_gemma4(tmp_path / "g4m", moe=True),
                                                        dtype=torch.float32).eval()
    rec, rows, probs = _record_routers(model, model.config.text_config, lambda out: out[0])
    assert rec.enabled and [layer for layer, _ in rec.routers] == list(range(5)) and rec.top_k == 2
    assert rows.shape == (9, 5, 2)
    for layer in range(5):
        assert torch.equal(rows[:, layer].long(), probs[layer].topk(2, dim=-1).indices), layer
    assert len(set(map(tuple, rows[:, 0].tolist()))) > 1      # the routing varies over tokens


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_qwen3_next_and_qwen35_routers_are_recorded(kind: str, tmp_path):
    """Qwen3-Next's and Qwen3.5-MoE's routers (``layers.L.mlp.gate``, Qwen3-MoE's ``(logits, scores, indices)``; the
    published Qwen3.5 layout's text decoder under ``model.language_model.``; not the shared expert's gate) are
    recorded: each layer's row is the top-k of its router's logits (Miles's Qwen3.5 self-distillation commands pass
    --use-rollout-routing-replay)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from miles.utils.tiny_qwen35 import build_tiny_qwen35_model

    vlm = kind == "qwen3_5_moe"
    path = build_tiny_qwen35_model(tmp_path / kind, kind=kind, vlm=vlm)
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():       # routers drawn at random: routing differs between tokens
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    model.eval()
    config = getattr(model.config, "text_config", None) or model.config
    rec, rows, logits = _record_routers(model, config, lambda out: out[0])
    layers = config.num_hidden_layers
    assert rec.enabled and [layer for layer, _ in rec.routers] == list(range(layers)) and rec.top_k == 2
    assert rows.shape == (9, layers, 2)
    for layer in range(layers):
        assert torch.equal(rows[:, layer].long().sort(-1).values,
                           logits[layer].topk(2, dim=-1).indices.sort(-1).values), layer
    assert len(set(map(tuple, rows[:, 0].tolist()))) > 1


def test_nemotron_h_routers_are_recorded(tmp_path):
    """Nemotron-H's routers (``layers.L.mixer.gate`` of its MoE layers: sigmoid scores plus the correction bias,
    returning (logits, weights, indices)) are recorded: each MoE layer's row is its router's top-k, the Mamba,
    attention and MLP layers' rows zero (Miles's Nemotron-3 Super command passes --use-rollout-routing-replay)."""
    from transformers import AutoModelForCausalLM

    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_nemotron_model(tmp_path / "nh"), dtype=torch.float32).eval()
    rec, rows, chosen = _record_routers(model, model.config, lambda out: out[2])
    assert rec.enabled and [layer for layer, _ in rec.routers] == [1, 4] and rec.top_k == 2     # pattern ME*-E
    assert rows.shape == (9, 5, 2)
    for layer in (1, 4):
        assert torch.equal(rows[:, layer].long(), chosen[layer]), layer
    assert (rows[:, [0, 2, 3]] == 0).all() and len(set(map(tuple, rows[:, 1].tolist()))) > 1


def _family_model(family: str, d):
    if family == "glm4_moe":
        from miles.utils.tiny_glm4_moe import build_tiny_glm4_moe
        return build_tiny_glm4_moe(d, n_routed_experts=8, n_group=2, topk_group=1)
    if family == "gpt_oss":
        from miles.utils.tiny_gpt_oss import build_tiny_gpt_oss_model
        return build_tiny_gpt_oss_model(d, num_experts=8)
    if family == "deepseek_v4":
        from miles.utils.tiny_dsv4 import build_tiny_dsv4_model
        return build_tiny_dsv4_model(d, n_routed_experts=8)
    from miles.utils.tiny_dsa import build_tiny_dsa_model
    return build_tiny_dsa_model(d, model_type=family, n_routed_experts=8)


def _family_choice(family: str, router, h: torch.Tensor, ids: torch.Tensor, config) -> torch.Tensor:
    """The experts [T, k] the family's routing formula picks for router input ``h`` (written out here, not HF's)."""
    import torch.nn.functional as F

    h, k = h.reshape(-1, h.shape[-1]).float(), config.num_experts_per_tok
    if family == "gpt_oss":                                     # top-k of the biased logits (softmax after)
        return F.linear(h, router.weight.float(), router.bias.float()).topk(k, -1).indices
    if family == "deepseek_v4":
        if hasattr(router, "tid2eid"):                          # hash layer: the token-id table
            return router.tid2eid[ids.reshape(-1)]
        s = F.softplus(F.linear(h, router.weight.float())).sqrt() + router.e_score_correction_bias
        return s.topk(k, -1).indices
    s = torch.sigmoid(F.linear(h, router.weight.float())) + router.e_score_correction_bias
    g = int(getattr(config, "n_group", 1) or 1)
    if g > 1:                                                   # group score: its top 2; keep the best topk_group
        grp = s.view(s.shape[0], g, -1).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(grp).scatter(1, grp.topk(config.topk_group, -1).indices, 1.0)
        s = s.masked_fill(keep.repeat_interleave(s.shape[1] // g, 1) == 0, float("-inf"))
    return s.topk(k, -1).indices


@pytest.mark.parametrize("family, moe_layers", [("glm4_moe", [1, 2]), ("gpt_oss", [0, 1]),
                                                ("glm_moe_dsa", [1, 2]), ("deepseek_v32", [1, 2]),
                                                ("deepseek_v4", [0, 1, 2, 3])])
def test_family_routers_are_recorded(family: str, moe_layers: list[int], tmp_path):
    """GLM-4.5 (grouped sigmoid top-k with the correction bias), gpt-oss (``layers.L.mlp.router``: top-k of the
    biased logits), DeepSeek-V3.2 / GLM-5 (DeepSeek-V3's router) and DeepSeek-V4 (sqrtsoftplus top-k, and its hash
    layers' token-id table): each MoE layer's recorded row is the expert set the family's formula picks for that
    router's input, a dense layer's row zero."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_family_model(family, tmp_path / family), dtype=torch.float32).eval()
    rec = RoutedExpertsRecorder(model, model.config)
    assert rec.enabled and [layer for layer, _ in rec.routers] == moe_layers and rec.top_k == 2
    inputs: dict[int, torch.Tensor] = {}
    for layer, mod in rec.routers:
        mod.register_forward_pre_hook(lambda _m, args, layer=layer: inputs.__setitem__(layer, args[0]))
    ids = torch.tensor([[5, 9, 13, 2, 7, 30, 41, 8, 11]])
    rec.begin()
    with torch.no_grad():
        model(input_ids=ids)
    rows = rec.end(ids.shape[1]).long()
    n = model.config.num_hidden_layers
    assert rows.shape == (9, n, 2)
    for layer, mod in rec.routers:
        want = _family_choice(family, mod, inputs[layer], ids, model.config)
        assert torch.equal(rows[:, layer].sort(-1).values, want.sort(-1).values), layer
    assert not rows[:, [i for i in range(n) if i not in moe_layers]].any()
    assert any(len(set(map(tuple, rows[:, i].tolist()))) > 1 for i in moe_layers)   # it varies over tokens


def test_only_requests_that_ask_record_their_routing(moe_model, monkeypatch):
    """Recording costs every forward it is armed for (router hooks, a row copy per token): a request without
    ``return_routed_experts`` arms nothing (no ``begin``, no hook on a router), and one that asks in the same engine
    and the same batch, sharing the other's prompt, still gets its rows: one recorded prefill (the shared prompt's,
    recorded for the samples that ask) and each asking sample's decode steps, nothing of the other request's."""
    armed: list[int] = []
    begin = RoutedExpertsRecorder.begin
    monkeypatch.setattr(RoutedExpertsRecorder, "begin", lambda self: (armed.append(1), begin(self))[1])
    prompt, new = [5, 9, 13, 2, 7, 30], 5
    params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
    eng = Engine(EngineArgs(hf_checkpoint=str(moe_model), max_context_len=96, max_running_requests=4, random_seed=0))
    eng.start()
    rec = eng.runner.impl.recorder
    try:
        plain = _run(eng, [{"input_ids": prompt, "sampling_params": {**params, "n": 2}}])
        assert armed == [] and all(not mod._forward_hooks for _, mod in rec.routers)
        assert all("routed_experts" not in o["meta_info"] for o in plain)

        async def mixed():   # one submit: admitted together, the asking samples share the plain request's prefill
            specs, _ = eng.prepare(GenerateReqInput(input_ids=prompt, sampling_params=params))
            asks, _ = eng.prepare(GenerateReqInput(input_ids=prompt, return_routed_experts=True,
                                                   sampling_params={**params, "n": 2, "sampling_seed": 3}))
            return await asyncio.wait_for(eng.wait_final(eng.submit(specs + asks, stream=False)), 120)
        outs = asyncio.run(mixed())
    finally:
        eng.stop()
    assert len(armed) == 1 + 2 * (new - 1)
    assert all(not mod._forward_hooks for _, mod in rec.routers)
    assert "routed_experts" not in outs[0]["meta_info"]
    for o in outs[1:]:
        tokens = prompt + o["output_ids"]
        got = decode(o["meta_info"]["routed_experts"], LAYERS, TOPK)
        np.testing.assert_array_equal(got[:, [0, 2]], _hf_routing(moe_model, tokens[:-1])[:, [0, 2]])
