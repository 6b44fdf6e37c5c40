"""The engine on a CUDA GPU: native forward vs HF in bf16, CUDA-graph decode, CUDA IPC weight hand-off,
memory release/resume. Skipped without a GPU (CI); run on the GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from miles.engine.model_runner import ModelRunner, RunnerOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles.utils.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("gpu_model")
    tok = build_tokenizer(out)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    model.to(torch.bfloat16).save_pretrained(str(out))
    return out


def test_native_bf16_and_cuda_graphs_match_hf(gpu_model):
    runner = ModelRunner(gpu_model, RunnerOptions(device="cuda", dtype="bfloat16", max_running_requests=8, max_context_len=300))
    assert runner.native and runner.impl.use_graphs
    hf = runner.model
    seqs = [[5 + i for i in range(40)], [7, 8, 9], [11] * 17]
    last, _ = runner.prefill(0, seqs, [False] * 3)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor([s], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(last[i], ref, dim=0) > 0.999
    toks = torch.tensor([3, 4, 5], device="cuda")
    pos = torch.tensor([len(s) for s in seqs], device="cuda")
    # graph replay and the eager step compute the same thing (run eager first: both write the same K/V)
    runner.impl.use_graphs = False
    eager = runner.decode(toks, pos, int(pos.max()) + 1).clone()
    runner.impl.use_graphs = True
    graphed = runner.decode(toks, pos, int(pos.max()) + 1)
    assert len(runner.impl.graphs) == 1
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=0)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor([s + [int(toks[i])]], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(graphed[i], ref, dim=0) > 0.999


def test_uniform_prefill_reads_grouped_kv_in_flash_attention_without_cudnn(gpu_model):
    """A batch of prompts of one length takes flash attention over the grouped K/V heads (``enable_gqa``, no repeated
    copies) and never cuDNN's attention, whose per-shape plans cost ~170 ms a prefill (docs/benchmarks.md): its
    logits equal those of the same prompts prefilled with a ragged partner (the masked, repeated-K/V path), rows
    alike, within bf16 (another kernel)."""
    from torch.profiler import ProfilerActivity, profile

    runner = ModelRunner(gpu_model, RunnerOptions(device="cuda", dtype="bfloat16", max_running_requests=8,
                                                  max_context_len=300))
    assert runner.impl.group > 1
    seqs = [[5 + (i * 7 + j) % 90 for j in range(48)] for i in range(3)]
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        uniform, _ = runner.prefill(0, seqs, [False] * 3)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert not any("cudnn" in n.lower() for n in names), [n for n in names if "cudnn" in n.lower()]
    assert any("flash" in n.lower() for n in names), names
    ragged, _ = runner.prefill(3, seqs + [[9, 10, 11]], [False] * 4)     # masked path: efficient / math kernels
    rel = ((uniform - ragged[:3]).norm() / ragged[:3].norm()).item()
    print(f"uniform (flash, grouped K/V) vs ragged (masked, repeated K/V) prefill logits: {rel:.2e}")
    assert rel < 1e-2       # bf16 attention by two kernels: measured 4.60e-3 (H100, 2026-12-07), about half


def test_server_on_gpu_ipc_update_and_memory_release(gpu_model, tmp_path):
    from miles.engine.testing import EngineProc, serialized_ipc

    eng = EngineProc(gpu_model, "--device", "cuda", "--dtype", "float32", "--max-running-requests", "8",
                     "--max-context-len", "256", log=tmp_path / "engine.log", timeout=300)
    try:
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
        first = eng.generate(body)["output_ids"]
        assert eng.generate(body)["output_ids"] == first
        name = "model.layers.1.mlp.down_proj.weight"
        new = torch.randn(256, 512, device="cuda") * 0.1
        r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized_ipc([(name, new)])],
                                                     "weight_version": "ipc"})  # a CUDA IPC handle, not the bytes
        assert r.status_code == 200 and r.json()["success"], r.text
        got = torch.tensor(eng.post("/get_weights_by_name", {"name": name, "truncate_size": 3}).json())
        assert torch.equal(got, new[:3].cpu())
        after = eng.generate(body)
        assert after["meta_info"]["weight_version"] == "ipc"
        used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        assert eng.post("/release_memory_occupation", {}).status_code == 200
        freed = used - (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0])
        assert freed > 0
        assert eng.post("/resume_memory_occupation", {}).status_code == 200
        assert eng.generate(body)["output_ids"] == after["output_ids"]
    finally:
        eng.stop()


def test_paged_cache_kernel_and_cuda_graphs_match_the_slot_cache(gpu_model):
    """The paged cache on GPU (Triton decode kernel, CUDA graphs on): bf16 logits track HF, graph replay equals
    the eager step, and the engine's greedy tokens and log-probs (fp32) equal the slot cache's, with a roomy
    pool, with a pool so small that running requests are retracted, and with prompts prefilled in chunks of 8
    tokens between decode steps; every page comes back."""
    from test_paged_cache import _bodies, _engine, _run, _same, _stats

    runner = ModelRunner(gpu_model, RunnerOptions(device="cuda", dtype="bfloat16", max_running_requests=8, max_context_len=300,
                                                  kv_cache="paged", page_size=16))
    assert runner.paged and runner.impl.kernel and runner.impl.use_graphs
    hf = runner.model
    seqs = [[5 + i for i in range(40)], [7, 8, 9], [11] * 17]
    last, _ = runner.prefill(0, seqs, [False] * 3)
    pos = torch.tensor([len(s) for s in seqs], device="cuda")
    runner.grow_pages([i for i, s in enumerate(seqs) if len(s) % 16 == 0])
    toks = torch.tensor([3, 4, 5], device="cuda")
    runner.impl.use_graphs = False
    eager = runner.decode(toks, pos, int(pos.max()) + 1).clone()
    runner.impl.use_graphs = True
    graphed = runner.decode(toks, pos, int(pos.max()) + 1)
    assert len(runner.impl.graphs) == 1
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=0)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor([s], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(last[i], ref, dim=0) > 0.999
            ref = hf(torch.tensor([s + [int(toks[i])]], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(graphed[i], ref, dim=0) > 0.999
    del runner
    common = dict(device="cuda", dtype="float32")
    outs = {}
    for name, kw in {"slots": dict(kv_cache="slots"), "paged": dict(kv_cache="paged", page_size=16),
                     "tight": dict(kv_cache="paged", page_size=4, max_total_tokens=128, max_running_requests=8),
                     "chunked": dict(kv_cache="paged", page_size=16, max_prefill_tokens=8)}.items():
        eng = _engine(gpu_model, **common, **kw)
        try:
            assert eng.runner.impl.use_graphs and (name == "slots" or eng.runner.impl.kernel)
            outs[name] = _run(eng, _bodies())
            stats = _stats(eng)
        finally:
            eng.stop()
        if name != "slots":
            assert stats["kv_pages_in_use"] == 0, stats
        if name == "tight":
            assert stats["retractions"] > 0, stats
        if name == "chunked":
            assert stats["chunked_prefills"] >= 3, stats
    _same(outs["paged"], outs["slots"], atol=1e-4)
    _same(outs["tight"], outs["slots"], atol=1e-4)
    _same(outs["chunked"], outs["slots"], atol=1e-4)


def test_fused_sampling_kernel_matches_the_torch_path_on_gpu(monkeypatch):
    """The Triton sampler (temperature only, mixed with greedy rows) draws the torch path's tokens and log-probs."""
    import miles.engine.sampling as S

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda", generator=g) * 3
    rows = [S.RowParams(0.5 + (i % 4) * 0.3, 1.0, 1 if i % 9 == 0 else 1 << 30, 0.0, 1000 + i) for i in range(64)]
    sb = S.SamplingBatch(rows, logits.shape[-1], logits.device)
    steps = torch.arange(64, device="cuda") * 3
    assert S.sample_kernel.available(logits.device)
    fused = S.sample(logits, sb, steps, want_logprobs=True)
    monkeypatch.setattr(S, "USE_FUSED_KERNEL", False)
    ref = S.sample(logits, sb, steps, want_logprobs=True)
    assert (fused.tokens != ref.tokens).sum().item() == 0
    torch.testing.assert_close(fused.logprobs, ref.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernels_match_their_torch_references(dtype):
    """Split-K paged attention (a large batch: few splits; a small one: many, merged by log-sum-exp) and the
    fused q/k-norm + RoPE, compiled for the GPU, equal the gather + SDPA / torch expressions."""
    from miles.engine import fused_ops
    from miles.engine import paged_attention as pa

    torch.manual_seed(0)
    dev = "cuda"
    kp = torch.randn(3000, 16, 8, 128, device=dev, dtype=dtype)
    vp = torch.randn(3000, 16, 8, 128, device=dev, dtype=dtype)
    for B in (256, 3):
        bt = torch.randint(1, 3000, (B, 80), device=dev)
        pos = torch.randint(0, 80 * 16, (B,), device=dev)
        q = torch.randn(B, 16, 128, device=dev, dtype=dtype)
        assert (pa.num_splits(B, 8, 80 * 16, 32) > 4) == (B == 3)
        ref = pa.reference(q.float(), kp.float(), vp.float(), bt, pos, 0.088, 80 * 16)
        got = pa.paged_decode(q, kp, vp, bt, pos, 0.088, rows=torch.arange(B, device=dev)).float()
        torch.testing.assert_close(got, ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)
    x = torch.randn(64, 48, 128, device=dev, dtype=dtype)[:, :16]
    w = torch.randn(128, device=dev, dtype=dtype)
    cos, sin = torch.randn(500, 128, device=dev, dtype=dtype), torch.randn(500, 128, device=dev, dtype=dtype)
    p = torch.randint(0, 500, (64,), device=dev)
    for weight in (w, None):
        torch.testing.assert_close(fused_ops.norm_rope(x, weight, 1e-6, cos, sin, p).float(),
                                   fused_ops.reference(x, weight, 1e-6, cos, sin, p).float(),
                                   atol=3e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2 if dtype == torch.bfloat16 else 0)
    # the residual add + RMSNorm and SwiGLU kernels round where the torch expressions round: equal up to one ulp
    h, d = torch.randn(200, 1024, device=dev, dtype=dtype), torch.randn(200, 1024, device=dev, dtype=dtype)
    nw = torch.rand(1024, device=dev, dtype=dtype) + 0.5
    got_h, got_x = fused_ops.add_rms_norm(h, d, nw, 1e-6)
    ref_h, ref_x = fused_ops.add_rms_norm_reference(h, d, nw, 1e-6)
    assert torch.equal(got_h, ref_h)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_x.float(), ref_x.float(), **tol)
    gu = torch.randn(200, 2 * 3072, device=dev, dtype=dtype) * 3
    torch.testing.assert_close(fused_ops.silu_mul(gu).float(), fused_ops.silu_mul_reference(gu).float(), **tol)


def test_head_dim_not_a_power_of_two_takes_the_torch_path_on_gpu(tmp_path):
    """The Triton decode and q/k-norm+RoPE kernels index the head dimension with ``tl.arange``, which needs a
    power of two: a model with head_dim 48 runs the paged cache on the torch path and still tracks HF."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles.utils.tiny_model import build_tokenizer

    tok = build_tokenizer(tmp_path)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=48, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp_path))
    runner = ModelRunner(tmp_path, RunnerOptions(device="cuda", dtype="bfloat16", max_running_requests=4, max_context_len=128,
                                                 kv_cache="paged", page_size=16))
    assert runner.paged and not runner.impl.kernel and not runner.impl.fused_rope
    seqs = [[5 + i for i in range(20)], [7, 8, 9]]
    runner.prefill(0, seqs, [False] * 2)
    toks = torch.tensor([3, 4], device="cuda")
    pos = torch.tensor([len(s) for s in seqs], device="cuda")
    out = runner.decode(toks, pos, int(pos.max()) + 1)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = runner.model(torch.tensor([s + [int(toks[i])]], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(out[i].float(), ref, dim=0) > 0.999


def test_mixed_steps_graph_replay_matches_eager_and_the_slot_cache(gpu_model):
    """Mixed prefill + decode steps on GPU: the captured mixed graph equals the eager mixed step (bf16), the chunk's
    last logits track HF, and the engine's refills ridden in decode steps (fp32, graphs on) give the slot cache's
    greedy and seeded tokens and log-probs, with one chunk per prompt and with chunks of 8 over several steps."""
    from test_mixed_steps import _bodies
    from test_paged_cache import _engine, _run, _same, _stats

    runner = ModelRunner(gpu_model, RunnerOptions(device="cuda", dtype="bfloat16", max_running_requests=8, max_context_len=300,
                                                  kv_cache="paged", page_size=16))
    assert runner.mix_tokens > 0 and runner.impl.kernel and runner.impl.use_graphs
    seqs = [[5 + i for i in range(40)], [7, 8, 9], [11] * 17]
    runner.prefill(0, seqs, [False] * 3)
    runner.grow_pages([i for i, s in enumerate(seqs) if len(s) % 16 == 0])
    toks, pos = torch.tensor([3, 4, 5], device="cuda"), torch.tensor([len(s) for s in seqs], device="cuda")
    chunk = [20 + i for i in range(45)]
    runner.impl.use_graphs = False
    eager = runner.decode_mixed(toks, pos, int(pos.max()) + 1, runner.chunk_row, chunk, 0).clone()
    runner.impl.use_graphs = True
    graphed = runner.decode_mixed(toks, pos, int(pos.max()) + 1, runner.chunk_row, chunk, 0)
    assert len(runner.impl.mix_graphs) == 1 and graphed.shape == eager.shape == (4, runner.vocab_size)
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=0)
    with torch.no_grad():
        ref = runner.model(torch.tensor([chunk], device="cuda")).logits[0, -1].float()
        assert torch.nn.functional.cosine_similarity(graphed[3], ref, dim=0) > 0.999
        for i, s in enumerate(seqs):
            ref = runner.model(torch.tensor([s + [int(toks[i])]], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(graphed[i], ref, dim=0) > 0.999
    del runner
    outs = {}
    for name, kw in {"slots": dict(kv_cache="slots"), "mixed": dict(kv_cache="paged", page_size=16),
                     "mixed8": dict(kv_cache="paged", page_size=4, max_prefill_tokens=8)}.items():
        eng = _engine(gpu_model, device="cuda", dtype="float32", **kw)
        try:
            outs[name] = _run(eng, _bodies())
            stats = _stats(eng)
            if name != "slots":
                assert eng.runner.impl.mix_graphs, "mixed graphs are captured at start"
        finally:
            eng.stop()
        if name != "slots":
            assert stats["mixed_prefills"] > 0 and stats["kv_pages_in_use"] == 0, stats
    _same(outs["mixed"], outs["slots"], atol=1e-4)
    _same(outs["mixed8"], outs["slots"], atol=1e-4)


def test_mixed_steps_with_several_prompts_on_gpu(gpu_model):
    """Several riders on GPU (bf16): three prompt chunks in their ride rows replayed in the mixed graph equal the
    eager step and track HF; a step carrying more than ``mix_tokens`` prompt tokens runs eagerly and gives the same
    decode rows; the engine with every refill riding (fp32, graphs on) gives the slot cache's tokens and log-probs."""
    from test_mixed_steps import _bodies
    from test_paged_cache import _engine, _run, _same, _stats

    runner = ModelRunner(gpu_model, RunnerOptions(device="cuda", dtype="bfloat16", max_running_requests=8, max_context_len=600,
                                                  kv_cache="paged", page_size=16))
    assert runner.impl.use_graphs and runner.mix_step_tokens > runner.mix_tokens > 0
    seqs = [[5 + i for i in range(40)], [7, 8, 9], [11] * 17]
    runner.prefill(0, seqs, [False] * 3)
    runner.grow_pages([i for i, s in enumerate(seqs) if len(s) % 16 == 0])
    toks, pos = torch.tensor([3, 4, 5], device="cuda"), torch.tensor([len(s) for s in seqs], device="cuda")
    rows = runner.ride_rows
    prompts = [[20 + i for i in range(45)], [30 + i for i in range(60)], [9, 8, 7]]
    chunks = [(row, p, 0) for row, p in zip(rows, prompts)]
    runner.impl.use_graphs = False
    eager = runner.decode_mixed_many(toks, pos, int(pos.max()) + 1, chunks).clone()
    runner.impl.use_graphs = True
    graphed = runner.decode_mixed_many(toks, pos, int(pos.max()) + 1, chunks).clone()
    assert graphed.shape == eager.shape == (6, runner.vocab_size)
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=0)
    with torch.no_grad():
        for j, p in enumerate(prompts):
            ref = runner.model(torch.tensor([p], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(graphed[3 + j], ref, dim=0) > 0.999
    big = [[40 + i % 60 for i in range(300)], [50 + i % 7 for i in range(200)]]
    wide = runner.decode_mixed_many(toks, pos, int(pos.max()) + 1, [(rows[3], big[0], 0), (rows[4], big[1], 0)])
    assert wide.shape == (5, runner.vocab_size)
    torch.testing.assert_close(wide[:3], graphed[:3], atol=2e-2, rtol=0)   # the same decode tokens at the same positions
    with torch.no_grad():
        for j, p in enumerate(big):
            ref = runner.model(torch.tensor([p], device="cuda")).logits[0, -1].float()
            assert torch.nn.functional.cosine_similarity(wide[3 + j], ref, dim=0) > 0.999
    del runner
    outs = {}
    for name, kw in {"slots": dict(kv_cache="slots"), "riders": dict(kv_cache="paged", page_size=16)}.items():
        eng = _engine(gpu_model, device="cuda", dtype="float32", max_running_requests=6, **kw)
        try:
            eng.scheduler.mix_below = 6   # every refill rides
            outs[name] = _run(eng, _bodies())
            stats = _stats(eng)
        finally:
            eng.stop()
        if name != "slots":
            assert stats["mixed_prefills"] > 0 and stats["kv_pages_in_use"] == 0, stats
            assert stats["num_prefilling_reqs"] == 0, stats
    _same(outs["riders"], outs["slots"], atol=1e-4)


# ----------------------------------------------------------------------------- Qwen3-VL image prompts (miles.engine.vlm)
@pytest.fixture(scope="module")
def gpu_vlm(tmp_path_factory):
    from miles.engine.testing import build_engine_vlm

    return build_engine_vlm(tmp_path_factory.mktemp("gpu_vlm"))


def _vlm_prompt(cfg, n_tokens: int) -> list[int]:
    return [5, 6, cfg.vision_start_token_id] + [cfg.image_token_id] * n_tokens + [cfg.vision_end_token_id, 11, 7, 8, 9]


def _hf_vlm_logits(hf, ids: list[int], mm: dict) -> torch.Tensor:
    """HF's full forward on cuda (no cache; M-RoPE positions of the whole sequence) -> [T, V] float32."""
    t = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        return hf(input_ids=t, pixel_values=mm["pixel_values"].cuda(), image_grid_thw=mm["image_grid_thw"].cuda(),
                  mm_token_type_ids=(t == hf.config.image_token_id).to(torch.int32)).logits[0].float()


def _hf_vlm_inputs(model_dir, ref: str) -> dict:
    from PIL import Image
    from transformers import AutoImageProcessor

    img = Image.open(io.BytesIO(base64.b64decode(ref.partition(",")[2]))).convert("RGB")
    out = AutoImageProcessor.from_pretrained(model_dir)(images=[img], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def test_vlm_image_prompts_on_gpu_match_hf(gpu_vlm, tmp_path):
    """The GPU twin of tests/unit/engine/test_engine_vlm.py: bf16 runner vs HF bf16 (teacher-forced, loose), then a float32
    server on cuda vs HF float32 on cuda (greedy tokens, log-probs), different images, a bad token count, a weight
    update by VLM names through CUDA IPC, and memory release/resume."""
    from transformers import Qwen3VLForConditionalGeneration

    from miles.engine.testing import EngineProc, image_data_url, serialized_ipc
    from miles.engine.vlm import VisionInputs

    img_a, img_b = image_data_url(1), image_data_url(2)
    # 1. bf16 in-process: prefill + cached decode steps against HF's uncached bf16 forward of the same weights
    runner = ModelRunner(gpu_vlm, RunnerOptions(device="cuda", dtype="bfloat16", max_running_requests=4, max_context_len=256))
    assert runner.is_vlm and not runner.native and runner.dtype == torch.bfloat16
    cfg = runner.config
    ids = _vlm_prompt(cfg, 4)
    mm = VisionInputs(str(gpu_vlm), cfg).prepare([img_a], ids)
    last, _ = runner.prefill(0, [ids], [False], [mm])
    hf_mm = {"pixel_values": mm.pixel_values, "image_grid_thw": mm.grid}
    seq = list(ids)
    for step in range(8):
        ref = _hf_vlm_logits(runner.model, seq, hf_mm)[-1]
        got = last[0]
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.995, step
        tok = int(got.argmax())
        gap = (torch.log_softmax(got, -1)[tok] - torch.log_softmax(ref, -1)[tok]).abs().item()
        assert gap < 0.1, (step, gap)
        seq.append(tok)
        last = runner.decode(torch.tensor([tok], device="cuda"), torch.tensor([len(seq) - 1], device="cuda"), len(seq))
    del runner
    torch.cuda.empty_cache()

    # 2. the server on cuda (float32) against HF float32 on cuda
    hf = Qwen3VLForConditionalGeneration.from_pretrained(gpu_vlm).cuda().eval()
    eng = EngineProc(gpu_vlm, "--device", "cuda", "--dtype", "float32", "--max-running-requests", "4",
                     "--max-context-len", "256", log=tmp_path / "engine.log", timeout=300)
    try:
        def gen(image, n=12):
            return eng.generate({"input_ids": ids, "image_data": [image], "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})

        def check_against(model, out, image):
            mmi = _hf_vlm_inputs(gpu_vlm, image)
            toks = out["output_ids"]
            ref = torch.log_softmax(_hf_vlm_logits(model, ids + toks, mmi), -1)
            for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
                row = ref[len(ids) - 1 + i]
                assert abs(lp - row[tok].item()) < 2e-3, i
                assert row[tok].item() > row.max().item() - 2e-3, i      # greedy under HF too (up to ties)

        a = gen(img_a)
        check_against(hf, a, img_a)
        b = gen(img_b)
        check_against(hf, b, img_b)
        diff = max(abs(x[0] - y[0]) for x, y in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]))
        assert diff > 1e-2
        r = eng.post("/generate", {"input_ids": _vlm_prompt(cfg, 3), "image_data": [img_a]})
        assert r.status_code == 400 and "need [4]" in r.json()["message"] and "\n" not in r.json()["message"]

        # weight update by the VLM's HF names, through CUDA IPC handles
        g = torch.Generator(device="cuda").manual_seed(3)
        params = dict(hf.named_parameters())
        named = []
        for name in ("model.visual.merger.linear_fc2.weight", "model.language_model.layers.1.mlp.down_proj.weight",
                     "lm_head.weight"):
            p = params[name]
            new = (p.detach() + torch.randn(p.shape, generator=g, device="cuda") * 0.2).contiguous()
            with torch.no_grad():
                p.copy_(new)
            named.append((name, new))
        r = eng.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized_ipc(named)],
                                                     "weight_version": "vlm-ipc"})
        assert r.status_code == 200 and r.json()["success"], r.text
        after = gen(img_a)
        assert after["meta_info"]["weight_version"] == "vlm-ipc" and after["output_ids"] != a["output_ids"]
        check_against(hf, after, img_a)

        # memory release / resume keeps the updated weights
        assert eng.post("/release_memory_occupation", {}).status_code == 200
        assert eng.post("/resume_memory_occupation", {}).status_code == 200
        again = gen(img_a)
        assert again["output_ids"] == after["output_ids"]
    finally:
        eng.stop()


def test_overlap_scheduler_matches_the_serial_one_with_cuda_graphs(gpu_model):
    """The overlap scheduler on GPU (its default there; CUDA graphs, the paged decode kernel, fp32): the same greedy
    and seeded tokens and log-probs (top-k and token-id ones too) as ``--disable-overlap-schedule``, for varied
    lengths, stop tokens and strings, n > 1 and min_new_tokens, on the slot cache, the paged cache, a pool small
    enough to retract, and refills riding in decode steps in chunks of 8; steps overlapped, the tokens computed past
    a finished request's end were dropped, and every page came back."""
    from test_overlap import _bodies, _flat, _run_case
    from test_paged_cache import _same

    common = dict(device="cuda", dtype="float32")
    bodies = _bodies(gpu_model, **common)
    cases = {"slots": dict(kv_cache="slots"), "paged": dict(kv_cache="paged", page_size=16),
             "tight": dict(kv_cache="paged", page_size=4, max_total_tokens=128, max_running_requests=8),
             "mixed8": dict(kv_cache="paged", page_size=4, max_prefill_tokens=8)}
    for name, kw in cases.items():
        ref, ref_stats = _run_case(gpu_model, bodies, False, {**common, **kw})
        got, stats = _run_case(gpu_model, bodies, None, {**common, **kw})   # the default on CUDA: overlap on
        _same(got, ref, atol=1e-4)
        for a, b in zip(got, ref):
            for key in ("output_top_logprobs", "output_token_ids_logprobs"):
                x, y = _flat(a["meta_info"].get(key, [])), _flat(b["meta_info"].get(key, []))
                assert len(x) == len(y) and all(abs(u - v) < 1e-4 if isinstance(u, float) else u == v
                                                for u, v in zip(x, y)), (name, key)
        assert ref_stats["overlap_steps"] == 0 and stats["overlap_steps"] > 0, (name, stats)
        assert stats["overlap_dropped_tokens"] > 0 and stats["generated_tokens"] == ref_stats["generated_tokens"], stats
        if name != "slots":
            assert stats["kv_pages_in_use"] == 0 and ref_stats["kv_pages_in_use"] == 0, (name, stats)
        if name == "tight":
            assert stats["retractions"] > 0, stats
        if name == "mixed8":
            assert stats["mixed_prefills"] > 0, stats
