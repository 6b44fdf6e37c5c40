"""The engine's own forward (static slot KV cache) against HF's forward, per architecture family."""

from __future__ import annotations

import pytest
import torch

from miles.engine.model_runner import ModelRunner, RunnerOptions


def _save(model, tmp_path):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(str(tmp_path))
    return tmp_path


def _config(kind: str):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_theta=5000.0, tie_word_embeddings=False))
    if kind == "llama-rope-scaling":
        rs = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32, "rope_theta": 10000.0}
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=rs))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16))
    if kind == "mistral-window":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=6))
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=256))
    raise KeyError(kind)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
@pytest.mark.parametrize("kind", ["llama", "llama-rope-scaling", "qwen2", "qwen3", "mistral-window", "gpt2"])
def test_prefill_and_decode_match_hf(kind, kv_cache, tmp_path):
    path = _save(_config(kind), tmp_path)
    runner = ModelRunner(path, RunnerOptions(max_running_requests=4, max_context_len=64, kv_cache=kv_cache, page_size=4))
    assert runner.paged == (kv_cache == "paged" and kind != "gpt2")
    assert runner.native == (kind != "gpt2")
    hf = runner.model
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]
    last, full = runner.prefill(0, seqs, [True, False, True])
    # fp32 against the HF forward (CPU, 2026-12-07, every kind and cache): the last logits measured 1.9e-7 apart, the
    # full ones equal; the decode steps below 4.8e-7
    for i, s in enumerate(seqs):
        ref = hf(torch.tensor([s])).logits[0].float()
        torch.testing.assert_close(last[i], ref[-1], atol=4e-7, rtol=0)
        if full[i] is not None:
            torch.testing.assert_close(full[i], ref, atol=0, rtol=0)
    # three decode steps for all rows, then drop row 0 (row 2 moves into slot 0) and continue
    seqs = [list(s) for s in seqs]
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 3:
            runner.release_slot(0)
            runner.move_slot(2, 0, len(seqs[2]))
            seqs = [seqs[2], seqs[1]]
        runner.grow_pages([i for i, s in enumerate(seqs) if len(s) % 4 == 0])  # a no-op for the slot cache
        new = torch.randint(0, 97, (len(seqs),), generator=g)
        pos = torch.tensor([len(s) for s in seqs])
        logits = runner.decode(new, pos, int(pos.max()) + 1)
        for i, s in enumerate(seqs):
            s.append(int(new[i]))
            ref = hf(torch.tensor([s])).logits[0, -1].float()
            torch.testing.assert_close(logits[i], ref, atol=1e-6, rtol=0)


def test_bad_checkpoint_and_cache_size_are_clear(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ModelRunner(tmp_path, RunnerOptions())
    path = _save(_config("qwen3"), tmp_path / "m")
    with pytest.raises(ValueError, match="--max-running-requests"):
        ModelRunner(path, RunnerOptions(max_running_requests=1 << 20, max_context_len=1 << 16))


@pytest.mark.parametrize(("flags", "needle"), [
    (["--port", "70000"], "--port 70000 is out of range"),
    (["--weight-update-timeout", "0"], "--weight-update-timeout 0 must be positive"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens 0 must be at least 1"),
])
def test_engine_cli_rejects_bad_values_before_loading(flags, needle, capsys):
    from miles.engine.__main__ import main

    with pytest.raises(SystemExit) as ei:
        main(["--hf-checkpoint", "/nonexistent", *flags])  # no model is read: the flags fail first
    assert ei.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("value", ["abc", "0"])
def test_engine_rejects_a_bad_switch_interval_in_one_line(value, monkeypatch, capsys):
    import sys

    from miles.engine.__main__ import main

    before = sys.getswitchinterval()
    monkeypatch.setenv("MILES_ENGINE_SWITCH_INTERVAL", value)
    assert main(["--hf-checkpoint", "/nonexistent"]) == 2    # before any model is read
    err = capsys.readouterr().err
    assert "MILES_ENGINE_SWITCH_INTERVAL" in err and repr(value) in err and "Traceback" not in err, err
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_fused_projections_follow_weight_updates_and_memory_release(kind, tmp_path):
    """q/k/v (with Qwen2's biases) and gate/up run as one GEMM each over fused buffers whose parts are the HF
    parameters' storage: an in-place update by name (the trainer's weight sync) and a release/resume of the
    weights reach the fused GEMMs; the decode step then equals a runner loaded from a checkpoint of the new
    weights."""
    path = _save(_config(kind), tmp_path / "a")
    runner = ModelRunner(path, RunnerOptions(max_running_requests=2, max_context_len=64, kv_cache="paged", page_size=4))
    impl = runner.impl
    assert all(f is not None for f in impl.qkv) and all(w is not None for w in impl.gate_up)
    attn0 = impl.layers[0].self_attn
    assert attn0.k_proj.weight.data_ptr() == impl.qkv[0][0][impl.n_heads * impl.head_dim:].data_ptr()
    g = torch.Generator().manual_seed(3)
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.self_attn.q_proj.weight"] + (["model.layers.0.self_attn.v_proj.bias"] if kind == "qwen2" else [])
    update = {n: torch.randn(runner.named_tensors()[n].shape, generator=g) * 0.2 for n in names}
    assert runner.load_tensors(update) == len(update)
    runner.release({"weights"})
    runner.resume({"weights"})
    assert impl.layers[1].mlp.up_proj.weight.data_ptr() == impl.gate_up[1][impl.gate_up[1].shape[0] // 2:].data_ptr()
    model = runner.model
    with torch.no_grad():
        for n, t in update.items():
            torch.testing.assert_close(model.get_parameter(n), t, rtol=0, atol=0)     # measured: bit for bit
    model.save_pretrained(str(tmp_path / "b"))
    fresh = ModelRunner(tmp_path / "b", RunnerOptions(max_running_requests=2, max_context_len=64, kv_cache="paged",
                                                      page_size=4))
    seqs = [[5, 6, 7, 8, 9], [20, 21, 22]]
    outs = []
    for r in (runner, fresh):
        last, _ = r.prefill(0, seqs, [False, False])
        r.grow_pages([])
        step = r.decode(torch.tensor([40, 41]), torch.tensor([5, 3]), 6)
        outs.append((last, step))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=0, rtol=0)        # measured: bit for bit
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=0, rtol=0)


def test_checkpoint_names_reach_renamed_and_fused_tensors(tmp_path):
    """Nemotron-H's checkpoint names its tensors ``backbone.*`` and each expert apart; transformers 5 loads them as
    ``model.*`` with the experts fused (``mixer.experts.up_proj`` [E, I, H]). The engine's index answers to the
    checkpoint's names (reads and in-place updates reach the live tensors), a full checkpoint under them covers every
    tensor, and a weight update by them changes what the model computes."""
    from safetensors.torch import load_file

    from miles.engine.weights import load_from_disk
    from miles.utils.tiny_nemotron import build_tiny_nemotron_model

    d = build_tiny_nemotron_model(tmp_path / "nemotron")
    ckpt = load_file(str(d / "model.safetensors"))
    assert any(n.startswith("backbone.") for n in ckpt) and "backbone.layers.1.mixer.experts.2.up_proj.weight" in ckpt
    r = ModelRunner(d, RunnerOptions(max_running_requests=2, max_context_len=32))
    live = r.named_tensors()
    assert all(n.startswith(("model.", "lm_head.")) for n in live)           # transformers' own names
    for name, t in ckpt.items():
        assert name in live and torch.equal(live[name], t), name
    state = load_from_disk(str(d), live)                                    # full coverage by the checkpoint's names
    assert set(state) == set(ckpt)
    before = r.prefill(0, [[5, 6, 7, 8]], [False])[0]
    new = {"backbone.layers.1.mixer.experts.2.up_proj.weight": torch.randn_like(ckpt["backbone.layers.1.mixer.experts.2.up_proj.weight"]),
           "backbone.norm_f.weight": ckpt["backbone.norm_f.weight"] * 2}
    assert r.load_tensors(new) == 2
    assert torch.equal(r.model.model.layers[1].mixer.experts.up_proj[2], new["backbone.layers.1.mixer.experts.2.up_proj.weight"])
    assert torch.equal(r.model.model.norm_f.weight, new["backbone.norm_f.weight"])
    assert not torch.equal(r.prefill(0, [[5, 6, 7, 8]], [False])[0], before)


def test_text_only_multimodal_checkpoint_kimi_k25(tmp_path):
    """Kimi-K2.5 (``kimi_k25``: transformers builds it only as an image-text-to-text model) is served on text; the
    published checkpoint's names (``language_model.model.*``, ``language_model.lm_head.weight``) reach the live
    tensors, a per-expert one included. A disk-delta full version of its text model alone (what the Megatron trainer
    exports) loads when its manifest says it is partial, and is refused as lacking the towers otherwise."""
    from safetensors.torch import load_file

    from miles.engine.weights import WeightUpdateError, load_from_disk
    from miles.utils.build_imports import has_causal_lm
    from miles.utils.tiny_kimi_k25 import build_tiny_kimi_k25
    from miles.weight_sync.disk_delta import write_version

    d = build_tiny_kimi_k25(tmp_path / "k25")
    r = ModelRunner(d, RunnerOptions(max_running_requests=2, max_context_len=32))
    assert not has_causal_lm(r.config) and type(r.model).__name__ == "Kimi_K25ForConditionalGeneration"
    live = r.named_tensors()
    ckpt = load_file(str(d / "model.safetensors"))
    text = {n: t for n, t in ckpt.items() if n.startswith("language_model.")}
    for name in ("language_model.lm_head.weight", "language_model.model.layers.2.mlp.experts.3.up_proj.weight",
                 "language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        assert name in live and torch.equal(live[name], text[name]), name
    for partial in (True, False):
        path = write_version(tmp_path / f"v{int(partial)}", 1, text.items(), baseline=None, model_dir=d, partial=partial)
        if partial:
            assert set(load_from_disk(str(path), live)) == set(text)
        else:
            with pytest.raises(WeightUpdateError, match="the checkpoint lacks"):
                load_from_disk(str(path), live)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_release_and_resume_on_cpu_keep_the_cache_and_free_its_pages(kv_cache, tmp_path):
    """On CPU, release_memory_occupation keeps the KV cache's tensors (host memory: nothing to give back to a
    colocated trainer, and zeroing the cache again at each resume is what a step would pay); resume starts the
    bookkeeping afresh (every page free), and a prefill after it matches HF."""
    path = _save(_config("qwen3"), tmp_path)
    runner = ModelRunner(path, RunnerOptions(max_running_requests=4, max_context_len=64, kv_cache=kv_cache, page_size=4))
    seq = [5, 6, 7, 8, 9, 10, 11]
    runner.prefill(0, [seq], [False])
    before = [t.data_ptr() for t in runner.impl.k_cache]
    runner.release_slot(0)
    runner.release({"kv_cache", "weights"})
    assert not runner.ready
    runner.resume({"kv_cache", "weights"})
    assert runner.ready
    assert [t.data_ptr() for t in runner.impl.k_cache] == before
    if runner.paged:
        assert runner.impl.kv.pool.num_used == 0 and runner.impl.kv.tables == [[] for _ in runner.impl.kv.tables]
    last, _ = runner.prefill(0, [seq[:5]], [False])
    # measured 1.2e-7 (CPU, 2026-12-07)
    ref = runner.model(torch.tensor([seq[:5]])).logits[0, -1].float()
    torch.testing.assert_close(last[0], ref, atol=2.5e-7, rtol=0)


class _SlowOn(torch.nn.Module):
    """The runner's model on a clock of its own: each forward advances ``clock`` by 1 ms, and by 20 ms more when
    torch runs on ``slow`` intra-op threads (1 or "many"). The forward itself still runs (the pick's real path);
    only the time it reads is this clock, so the machine's load cannot decide the test."""

    def __init__(self, model, slow: str):
        super().__init__()
        self.inner, self.slow, self.clock = model, slow, 0.0

    def perf_counter(self) -> float:
        return self.clock

    def forward(self, **kw):
        out = self.inner(**kw)
        self.clock += 0.001 + (0.02 if (torch.get_num_threads() == 1) == (self.slow == "1") else 0.0)
        return out


@pytest.mark.parametrize("slow, kept", [("many", 1), ("1", 2)])
def test_pick_cpu_threads_keeps_the_faster_count(slow, kept, tmp_path, monkeypatch):
    """--pick-cpu-threads: a one-token forward timed on the thread's intra-op threads and on one; the faster count
    stays set for every later forward (here the model's clock makes one side 20 ms slower, so either answer can
    come out and the test fails if the choice ignores the timings)."""
    import miles.engine.model_runner as mr

    path = _save(_config("qwen3"), tmp_path)
    runner = ModelRunner(path, RunnerOptions(max_running_requests=4, max_context_len=64))
    runner.model = slow_model = _SlowOn(runner.model, slow)
    monkeypatch.setattr(mr.time, "perf_counter", slow_model.perf_counter)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert runner.pick_cpu_threads(reps=2) == kept
        assert torch.get_num_threads() == kept
        torch.set_num_threads(1)                        # one thread: nothing to pick, no forward timed
        runner.model = None
        assert runner.pick_cpu_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_engine_cli_passes_pick_cpu_threads():
    """The launcher starts the embedded engine with --pick-cpu-threads under its share of the cores
    (miles/run/fleet.py); the flag reaches EngineArgs, off by default."""
    from miles.engine.__main__ import parse_args

    assert parse_args(["--hf-checkpoint", "x", "--pick-cpu-threads"]).pick_cpu_threads is True
    assert parse_args(["--hf-checkpoint", "x"]).pick_cpu_threads is False


def test_deterministic_inference_turns_the_thread_pick_off(tmp_path):
    """The pick follows timings, so it could differ between two runs: --enable-deterministic-inference keeps the
    process's threads (the engine's scheduler is built without the pick)."""
    from miles.engine.engine import Engine, EngineArgs

    path = _save(_config("qwen3"), tmp_path)
    base = dict(hf_checkpoint=str(path), max_context_len=64, max_running_requests=2, pick_cpu_threads=True)
    assert Engine(EngineArgs(**base)).scheduler.pick_cpu_threads is True
    assert Engine(EngineArgs(**base, deterministic=True)).scheduler.pick_cpu_threads is False
