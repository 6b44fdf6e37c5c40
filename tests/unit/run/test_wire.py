"""The sample wire format: round trip, every malformed payload -> SampleWireError, DP split, gloo scatter."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from miles.run.wire import SampleWireError, decode_samples, encode_samples, split_for_dp
from miles.types import Sample, SampleStatus

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from wire_worker import make_groups, summary  # noqa: E402


def samples() -> list[Sample]:
    return [
        Sample(group_index=1, index=3, rollout_id=7, prompt="héllo ✓ 日本語 🚀", tokens=[5, 6, 7, 8, 9], response="ok",
               response_length=3, loss_mask=[1, 0, 1], rollout_log_probs=[-0.5, 0.0, -1.25], reward=0.75,
               weight_version=12, status=SampleStatus.TRUNCATED, metadata={"ключ": ["値", 1, None], "x": {"y": 2.5}},
               label={"answer": "42"}, weight_versions=["11", "12"], remove_sample=True),
        Sample(),  # every optional field None, no tokens
        Sample(prompt=[{"role": "user", "content": "hi"}], tokens=[1], response_length=0, loss_mask=[],
               rollout_log_probs=None, status=SampleStatus.FAILED, label=None, reward=None),
    ]


def test_round_trip_including_none_fields_and_unicode():
    src = samples()
    out = decode_samples(encode_samples(src))
    assert out == src
    assert out[1].loss_mask is None and out[1].rollout_log_probs is None and out[2].loss_mask == []
    assert decode_samples(encode_samples([])) == []
    s = Sample(tokens=[1, 2], response_length=1, rollout_log_probs=[0.1])  # log-probs travel as float32
    assert decode_samples(encode_samples([s]))[0].rollout_log_probs == [pytest.approx(0.1, abs=1e-7)]


def test_never_pickle():
    data = encode_samples(samples())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    assert header["__metadata__"]["format"] == "miles.samples"
    assert {k for k in header if k != "__metadata__"} == {
        "tokens", "token_offsets", "loss_mask", "loss_mask_offsets", "log_probs", "log_prob_offsets"}
    assert b"\x80\x04" not in data[:2] and b"pickle" not in data


def _rewrite_header(data: bytes, edit) -> bytes:
    """Re-emit a payload with its header JSON edited (tensor data unchanged)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data[8 + n:]


def _edit_samples(fn):
    def edit(h):
        recs = json.loads(h["__metadata__"]["samples"])
        fn(recs)
        h["__metadata__"]["samples"] = json.dumps(recs)
    return edit


@pytest.mark.parametrize("make,match", [
    (lambda d: d[:5], "truncated payload: 5 bytes"),
    (lambda d: d[:40], "truncated payload: the header claims"),
    (lambda d: d[:-3], "truncated payload: tensor data needs"),
    (lambda d: d + b"xx", "length mismatch: 2 unexpected bytes"),
    (lambda d: d[:8] + b"[" + d[9:], "bad header: the safetensors header is not valid JSON"),
    (lambda d: b"junk", "truncated payload"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum mismatch"),
    (lambda d: _rewrite_header(d, lambda h: h["__metadata__"].update(format="other")), "bad header: format 'other'"),
    (lambda d: _rewrite_header(d, lambda h: h["__metadata__"].update(version="9")), "bad header: version '9'"),
    (lambda d: _rewrite_header(d, lambda h: h.pop("__metadata__")), "bad header: no __metadata__"),
    (lambda d: _rewrite_header(d, lambda h: h["__metadata__"].pop("samples")), "missing field: the samples JSON"),
    (lambda d: _rewrite_header(d, lambda h: h["tokens"].update(dtype="F32")), "wrong dtype: tensor 'tokens' is torch.float32"),
    (lambda d: _rewrite_header(d, _edit_samples(lambda r: r[0].pop("reward"))), "checksum mismatch"),
])
def test_malformed_payloads_raise_sample_wire_error(make, match):
    with pytest.raises(SampleWireError, match=match):
        decode_samples(make(encode_samples(samples())))


def test_decoder_checks_fields_even_with_a_valid_checksum(monkeypatch):
    import miles.run.wire as wire

    monkeypatch.setattr(wire, "_checksum", lambda t, j: "same")  # isolate the structural checks
    data = encode_samples(samples())
    for edit, match in [
        (_edit_samples(lambda r: r[0].pop("reward")), r"missing field: sample record 0 lacks \['reward'\]"),
        (_edit_samples(lambda r: r[0].update(response_length=4)), "length mismatch: sample 0 loss_mask has 3 entries"),
        (_edit_samples(lambda r: r[1].update(status="weird")), "unknown status 'weird'"),
        (_edit_samples(lambda r: r.pop()), "length mismatch: header count 3 but 2 sample records"),
    ]:
        with pytest.raises(SampleWireError, match=match):
            decode_samples(_rewrite_header(data, edit))


def test_encoder_rejects_inconsistent_samples():
    with pytest.raises(SampleWireError, match=r"sample 0 \(index 9\): loss mask has 2 entries, expected one per response token \(3\)"):
        encode_samples([Sample(index=9, tokens=[1, 2, 3], response_length=3, loss_mask=[1, 1])])
    with pytest.raises(SampleWireError, match="response_length 5 is outside 0..2"):
        encode_samples([Sample(tokens=[1, 2], response_length=5)])
    with pytest.raises(SampleWireError, match="not JSON-serialisable"):
        encode_samples([Sample(metadata={"x": object()})])
    with pytest.raises(SampleWireError, match="id outside"):
        encode_samples([Sample(tokens=[-1])])


def test_split_for_dp_keeps_groups_whole_and_balances_tokens():
    groups = make_groups(8)
    parts = split_for_dp(groups, 3)
    assert sorted(s.index for p in parts for s in p) == list(range(24))
    for p in parts:  # whole groups, in launch order
        gids = [s.group_index for s in p]
        assert gids == sorted(gids) and all(gids.count(g) == 3 for g in set(gids))
    counts = [len(p) // 3 for p in parts]
    assert max(counts) - min(counts) <= 1
    loads = [sum(len(s.tokens) for s in p) for p in parts]
    sizes = [sum(len(s.tokens) for s in g) for g in groups]
    assert max(loads) - min(loads) <= max(sizes)
    with pytest.raises(ValueError, match="raise --rollout-batch-size to at least 4"):
        split_for_dp(groups[:3], 4)


@pytest.mark.multiprocess
def test_scatter_over_real_gloo_group(tmp_path, free_port):
    procs = [subprocess.Popen([sys.executable, str(HERE / "wire_worker.py"), "--rank", str(r), "--world", "3",
                               "--port", str(free_port), "--out", str(tmp_path / f"r{r}.json")]) for r in range(3)]
    try:
        for p in procs:
            assert p.wait(timeout=90) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    expect = split_for_dp(make_groups(), 2)
    assert res[0]["scatter_default"] == [] and res[0]["roundtrip_equal"]
    for r in (1, 2):
        assert res[r]["roundtrip_equal"], f"rank {r} got different samples"
        assert res[r]["scatter_default"] == json.loads(json.dumps(summary(expect[r - 1]), ensure_ascii=False))
        assert "checksum mismatch" in res[r]["corrupt"] or "bad" in res[r]["corrupt"]
        assert res[r]["sizes_equal"] == [True] * 6
        assert "timed out after 1.5s" in res[r]["timeout"] and res[r]["timeout_s"] < 10
        assert "from rank 0 over group 'default' (3 ranks)" in res[r]["timeout"]
    assert res[2]["src_own_as_given"] is True
    assert [x[0] for x in res[1]["scatter_sub"]] == [0, 0, 0] and [x[0] for x in res[2]["scatter_sub"]] == [1, 1, 1]
