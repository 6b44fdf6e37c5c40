"""Rollout routing replay (R3) for the MoE families beyond Qwen3-MoE, engine to trainer, one process (CPU, gloo):
GLM-4.5 (sigmoid router with the correction bias, grouped top-k), gpt-oss (top-k of the biased logits, softmax
after), DSA (GLM-5: DeepSeek-V3's router) and DeepSeek-V4 (sqrtsoftplus with the correction bias, and hash layers
whose experts come from a token-id table).

The embedded engine serves the family's tiny model and returns each token's routed experts (SGLang's
``meta_info["routed_experts"]``). The Megatron trainer built from the same checkpoint routes every token exactly so
by itself (the engine records what the family's router chooses); built from a checkpoint whose routers are perturbed
(each router's experts shifted by one, V4's hash tables too) it routes a large share of (token, layer) pairs
otherwise, and with ``--use-rollout-routing-replay`` none: in the old log-prob pass and in a training step, whose
router weights still move (the gate weights come from the current router); the 6 samples in one forward
(right-padded rows) give the log-probs of one sample per forward. A spy on each router's routing map reads the
experts each token reaches. R2 (``--use-routing-replay``) on GLM-4.5 and V4: the training forwards route as the old
log-prob pass did after the routers are shifted in place.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from replay_families import FAMILIES, PROMPTS, perturbed
from trainer_harness import spy_routing

pytest.importorskip("megatron.core")

def _engine_samples(model_dir: Path) -> list:
    """The embedded engine's answers to PROMPTS (2 samples each) with ``return_routed_experts``, as samples."""
    from miles.engine.engine import Engine, EngineArgs
    from miles.engine.protocol import GenerateReqInput
    from miles.types import Sample

    eng = Engine(EngineArgs(hf_checkpoint=str(model_dir), max_context_len=64, max_running_requests=2, random_seed=0))
    eng.start()

    async def one(i, p):
        specs, _ = eng.prepare(GenerateReqInput(input_ids=p, return_routed_experts=True, sampling_params={
            "max_new_tokens": 5, "temperature": 1.0, "sampling_seed": i, "n": 2, "ignore_eos": True}))
        return await asyncio.wait_for(eng.wait_final(eng.submit(specs, stream=False)), 120)

    async def go():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])
    try:
        answers = asyncio.run(go())
    finally:
        eng.stop()
    out = []
    for g, (prompt, outs) in enumerate(zip(PROMPTS, answers)):
        for k, o in enumerate(outs):
            n = len(o["output_ids"])
            out.append(Sample(group_index=g, index=2 * g + k, tokens=prompt + o["output_ids"], response_length=n,
                              loss_mask=[1] * n, reward=float(k), rollout_log_probs=[-2.5] * n,
                              rollout_routed_experts=o["meta_info"]["routed_experts"]))
    return out


def _trainer(model_dir: Path, group, fam_flags: list[str], *extra: str, one_per_forward: bool = True):
    from trainer_harness import build, flags

    tr = build(model_dir, flags("megatron", ["--rollout-batch-size", "3", "--micro-batch-size", "1", "--lr", "1e-2",
                                             "--use-tis", *fam_flags, *extra]), group=group)
    if one_per_forward:
        tr.coalesce_tokens = lambda: 0  # one sample per forward: the spy reads the tokens in sample order
    return tr


def _mismatch(seen: list, recorded: dict[int, torch.Tensor]) -> tuple[float, int]:
    """Share of (token, MoE layer) pairs whose experts differ from the engine's record (the rows the engine ran: all
    tokens but each sample's last), and how many pairs were compared."""
    bad = total = 0
    for fwd in seen:
        (sid,) = fwd["sid"]
        ref = recorded[sid]
        for layer, sets in fwd.items():
            if layer == "sid":
                continue
            for t in range(ref.shape[0]):
                total += 1
                bad += sets[t] != sorted(ref[t, layer].tolist())
    return bad / max(total, 1), total


def _logprob_pass(tr, samples) -> list[torch.Tensor]:
    data = [tr._sample_data(s, i) for i, s in enumerate(samples)]
    if tr.routing_replay is not None:
        tr.routing_replay.begin(samples)
    tr.model.eval()
    return tr._forward_pass(tr.model, lambda mb: tr._policy_forward(tr.model, mb)[0], data)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_r3_trainer_routes_as_the_engine_recorded(family: str, tmp_path: Path, group):
    from miles.engine.routed_experts import decode

    build_model, fam_flags = FAMILIES[family]
    base = build_model(tmp_path / "base")
    pert = perturbed(base, tmp_path / "pert")
    samples = _engine_samples(base)
    cfg = __import__("json").loads((base / "config.json").read_text())
    layers, topk = int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])
    recorded = {s.index: torch.from_numpy(decode(s.rollout_routed_experts, layers, topk).copy()) for s in samples}
    assert all(r.shape[0] == len(s.tokens) - 1 for r, s in zip(recorded.values(), samples))

    tr = _trainer(base, group, fam_flags)       # the same weights: the family routes as the engine did
    seen = spy_routing(tr)
    _logprob_pass(tr, samples)
    own, pairs = _mismatch(seen, recorded)
    assert pairs > 50 and own == 0.0, own
    moe = sorted(k for k in seen[0] if k != "sid")
    dense = [i for i in range(layers) if i not in moe]
    assert moe and all(not bool(r[:, dense].any()) for r in recorded.values())   # a dense layer's rows are 0

    tr = _trainer(pert, group, fam_flags)       # perturbed routers, no replay: other experts
    seen = spy_routing(tr)
    _logprob_pass(tr, samples)
    assert _mismatch(seen, recorded)[0] > 0.9             # measured: 1.0 for each family

    tr = _trainer(pert, group, fam_flags, "--use-rollout-routing-replay")
    seen = spy_routing(tr)
    one = _logprob_pass(tr, samples)
    assert _mismatch(seen, recorded) == (0.0, pairs)
    seen.clear()
    router = {n: p.detach().clone() for n, p in tr.model.named_parameters() if n.endswith("mlp.router.weight")}
    metrics = tr.train(samples, 0)                        # the training forwards replay too
    assert len(seen) >= len(samples) and _mismatch(seen, recorded)[0] == 0.0
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    moved = [float((p.detach() - router[n]).abs().max()) for n, p in tr.model.named_parameters() if n in router]
    assert moved and min(moved) > 0                       # the gate weights come from the current router
    # the 6 samples in one forward (right-padded [s, b] rows; padding keeps its own top-k): the same log-probs, so
    # each token got its own replayed row
    coalesced = _trainer(pert, group, fam_flags, "--use-rollout-routing-replay", "--micro-batch-size", "6",
                         one_per_forward=False)
    forwards = spy_routing(coalesced)
    many = _logprob_pass(coalesced, samples)
    assert [sorted(f["sid"]) for f in forwards] == [list(range(len(samples)))]
    diff = max(float((a - b).abs().max()) for a, b in zip(one, many))
    # measured (this test, 2-core CPU box): 4.8e-7 (GLM-4.5, GLM-5), 0 (gpt-oss), 9.5e-7 (V4): fp32 rounding
    assert len(many) == len(one) and diff < 2e-6, diff


def _perturb_in_place(model) -> None:
    """The policy's routers shifted by one expert (weights, biases, hash tables), as ``replay_families.perturbed`` does on disk."""
    with torch.no_grad():
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            if re.search(r"mlp\.router\.(weight|bias|expert_bias)$", n) and t.is_floating_point():
                t.copy_(t.roll(1, 0))
            elif n.endswith("mlp.router.tid2eid"):
                t.copy_((t + 1) % int(t.max() + 1))


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v4"])
def test_r2_training_forwards_replay_the_old_pass(family: str, tmp_path: Path, group):
    """R2 (``--use-routing-replay``) on a family router: the old log-prob pass records the routing, the routers are
    then shifted in place, and the 2 training steps' forwards still route as recorded (without R2 they do not).
    DeepSeek-V4's router chooses in its own ``routing`` (sqrtsoftplus, hash layers): it asks the replay too."""
    build_model, fam_flags = FAMILIES[family]
    base = build_model(tmp_path / "base")
    samples = _engine_samples(base)
    out = {}
    for flag in ("--use-routing-replay", None):
        tr = _trainer(base, group, fam_flags, *([flag] if flag else []), "--num-steps-per-rollout", "2",
                      "--use-kl-loss", "--kl-loss-coef", "0.01")
        seen = spy_routing(tr)
        prepare = tr._prepare

        def shifted_after_old_pass(smp, data, policy, prepare=prepare, tr=tr):
            got = prepare(smp, data, policy)
            _perturb_in_place(tr.model)
            return got
        tr._prepare = shifted_after_old_pass
        tr.train(samples, 0)
        n = len(samples)
        old = {f["sid"][0]: f for f in seen[:n]}                   # the old log-prob pass, one sample a forward
        bad = total = 0
        for f in seen[n:]:                                           # the training forwards of the 2 steps
            for layer, sets in f.items():
                if layer != "sid":
                    total += len(sets)
                    bad += sum(a != b for a, b in zip(sets, old[f["sid"][0]][layer]))
        out[flag] = (len(seen) - n, bad / max(total, 1))
    assert out["--use-routing-replay"] == (len(samples), 0.0)
    assert out[None][0] == len(samples) and out[None][1] > 0.9        # measured: 1.0 (GLM-4.5), 0.97 (V4)


def test_a_router_choosing_without_the_replay_is_refused():
    """A family router that overrides megatron-core's ``routing`` is hooked only when it says it asks
    ``router_replay`` (``replays_routing``); else the flag is refused in one line naming the router, never accepted
    and dropped."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.router import TopKRouter
    from torch import nn

    from miles.config.base import ConfigError
    from miles.trainer.routing_replay import ReplayState, _hook_routers

    class OwnRouting(TopKRouter):
        def __init__(self):
            nn.Module.__init__(self)
            self.config = SimpleNamespace(moe_router_fusion=False)

        def routing(self, logits, padding_mask=None):
            raise AssertionError("not called")

    class AsksReplay(OwnRouting):
        replays_routing = True

    def model(router_cls):
        layer = nn.Module()
        layer.layer_number, layer.mlp = 1, nn.Module()
        layer.mlp.router = router_cls()
        m = nn.Module()
        m.decoder = nn.Module()
        m.decoder.layers = nn.ModuleList([layer])
        return m

    state = ReplayState("r3", 1, 2, 4, [0])
    with pytest.raises(ConfigError, match=r"^--use-rollout-routing-replay: OwnRouting \(decoder\.layers\.0\.mlp\.router\) "
                                          "chooses its experts without megatron-core's router_replay"):
        _hook_routers(model(OwnRouting), state, megatron=True)
    m = model(AsksReplay)
    assert _hook_routers(m, state, megatron=True) == 1 and m.decoder.layers[0].mlp.router.router_replay.layer == 0
