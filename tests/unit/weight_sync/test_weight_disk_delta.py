"""Disk-delta format: round trips, corruption and mismatch detection, atomic publication, HF loadability."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from miles.weight_sync import disk_delta as dd
from miles.weight_sync.disk_delta import DeltaError, apply_delta_dir, read_full_dir, write_version


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "h": torch.randn(257, generator=g).to(torch.bfloat16),
        "frozen": torch.randn(8, 8, generator=g),
        "step": torch.tensor(3, dtype=torch.int64),
    }


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in state.items()}
    new["w"] += 1e-3 * torch.randn(new["w"].shape, generator=g)
    new["h"][::3] = (new["h"][::3].float() + 0.5).to(torch.bfloat16)
    new["step"] += 1
    return new


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8) if a[k].dim() else a[k],
                                                                                  b[k].view(-1).view(torch.uint8) if b[k].dim() else b[k]) for k in a)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
@pytest.mark.parametrize("algo", ["xxh3-128", "blake3", "adler32"])  # Miles's --update-weight-delta-checksum names
def test_chain_of_deltas_is_bit_exact(tmp_path: Path, encoding: str, algo: str) -> None:
    s0 = _state()
    full = write_version(tmp_path, 0, s0.items(), baseline=None, checksum=algo)
    assert full.name == "full_v000000"
    engine = read_full_dir(full)
    assert _equal(engine, s0)
    prev = s0
    for v in (1, 2, 3):
        new = _step(prev, v)
        stats: dict = {}
        d = write_version(tmp_path, v, new.items(), baseline=prev, encoding=encoding, checksum=algo, stats=stats)
        assert d.name == f"delta_v{v:06d}" and dd.is_delta_dir(d)
        assert stats["num_unchanged"] == 1 and stats["num_tensors"] == 4
        engine = apply_delta_dir(d, engine, current_version=v - 1)
        assert _equal(engine, new)
        prev = new
    m = json.loads((tmp_path / "delta_v000003" / dd.DELTA_MANIFEST).read_text())
    assert m["encoding"] == encoding and m["checksum"] == algo and m["base_version"] == 2
    entry = next(e for e in m["tensors"] if e["name"] == "w")
    assert set(entry) >= {"name", "dtype", "shape", "file", "compressed_bytes", "delta_checksum", "result_checksum"}
    assert entry["delta_checksum"].startswith(algo + ":")


def test_new_or_reshaped_tensor_travels_raw(tmp_path: Path) -> None:
    s0 = _state()
    s1 = _step(s0, 1)
    s1["extra"] = torch.arange(5, dtype=torch.float16)
    s1["frozen"] = torch.zeros(4, 16)
    d = write_version(tmp_path, 1, s1.items(), baseline=s0, encoding="xor")
    out = apply_delta_dir(d, s0)
    assert _equal(out, s1)


def test_flipped_byte_is_caught_before_anything_is_applied(tmp_path: Path) -> None:
    s0, s1 = _state(), _step(_state(), 1)
    d = write_version(tmp_path, 1, s1.items(), baseline=s0, encoding="xor")
    m = json.loads((d / dd.DELTA_MANIFEST).read_text())
    f = d / next(e["file"] for e in m["tensors"] if e["name"] == "h")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    before = {k: v.clone() for k, v in s0.items()}
    with pytest.raises(DeltaError, match=r"tensor 'h'.*corrupted"):
        apply_delta_dir(d, s0)
    assert _equal(s0, before)  # untouched


def test_missing_piece_is_refused(tmp_path: Path) -> None:
    s0, s1 = _state(), _step(_state(), 1)
    d = write_version(tmp_path, 1, s1.items(), baseline=s0, encoding="overwrite")
    m = json.loads((d / dd.DELTA_MANIFEST).read_text())
    os.remove(d / next(e["file"] for e in m["tensors"] if e["name"] == "w"))
    with pytest.raises(DeltaError, match=r"tensor 'w'.*missing"):
        apply_delta_dir(d, s0)
    (d / dd.DELTA_MANIFEST).unlink()
    with pytest.raises(DeltaError, match="not a weight version dir"):
        apply_delta_dir(d, s0)


def test_base_version_mismatch_is_refused(tmp_path: Path) -> None:
    s0 = _state()
    s1 = _step(s0, 1)
    s2 = _step(s1, 2)
    d2 = write_version(tmp_path, 2, s2.items(), baseline=s1, encoding="xor")
    with pytest.raises(DeltaError, match="base version mismatch.*v1.*holds v0"):
        apply_delta_dir(d2, s0, current_version=0)
    # without a declared version the result checksums catch the wrong base
    with pytest.raises(DeltaError, match="base version mismatch"):
        apply_delta_dir(d2, s0)
    wrong_shape = dict(s1, w=torch.zeros(3))
    with pytest.raises(DeltaError, match="tensor 'w'.*base version mismatch"):
        apply_delta_dir(d2, wrong_shape)


def test_full_version_detects_corruption_and_is_a_loadable_hf_dir(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    state = load_file(str(tiny_model_dir / "model.safetensors"))
    state = {k: v + 0.25 for k, v in state.items()}
    full = write_version(tmp_path, 5, state.items(), baseline=None, model_dir=tiny_model_dir)
    assert (full / "config.json").is_file() and (full / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(full))
    for k, v in model.state_dict().items():
        if k in state:
            assert torch.equal(v, state[k]), k
    raw = bytearray((full / "model.safetensors").read_bytes())
    raw[-3] ^= 0x10
    (full / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(DeltaError, match="corrupted"):
        read_full_dir(full)


def test_full_version_shards_and_shared_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dd, "MAX_SHARD_BYTES", 4096)
    emb = torch.randn(40, 16)
    state = {"embed": emb, "lm_head": emb, "b": torch.randn(100)}  # tied weights share storage
    full = write_version(tmp_path, 1, state.items(), baseline=None)
    index = json.loads((full / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert _equal(read_full_dir(full), state)


def test_publication_is_atomic_and_failures_leave_nothing(tmp_path: Path) -> None:
    s0 = _state()

    def exploding():
        yield "w", s0["w"]
        raise RuntimeError("trainer died mid-write")

    with pytest.raises(RuntimeError, match="trainer died mid-write"):  # the source's own error, unchanged
        write_version(tmp_path, 1, exploding(), baseline=s0)
    assert list(tmp_path.iterdir()) == []  # no half-written version, no temp dir
    write_version(tmp_path, 0, s0.items(), baseline=None)
    write_version(tmp_path, 1, _step(s0, 1).items(), baseline=s0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta_v000001", "full_v000000"]
    removed = dd.prune_versions(tmp_path, keep_from=1)
    assert [p.name for p in removed] == ["full_v000000"]


def test_bad_flags_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--update-weight-delta-encoding"):
        write_version(tmp_path, 1, [], baseline={}, encoding="diff")
    with pytest.raises(ValueError, match="--update-weight-delta-checksum"):
        write_version(tmp_path, 1, [], baseline={}, checksum="md5")
    with pytest.raises(ValueError, match="--update-weight-delta-checksum"):  # the pre-rename name is read, not written
        write_version(tmp_path, 1, [], baseline={}, checksum="xxh3")


def test_checksum_flag_takes_miles_names_and_default() -> None:
    from miles.config import parse_args

    assert parse_args(["--hf-checkpoint", "x"], validate=False).weights.update_weight_delta_checksum == "xxh3-128"
    for algo in ("xxh3-128", "blake3", "adler32"):
        cfg = parse_args(["--hf-checkpoint", "x", "--update-weight-delta-checksum", algo], validate=False)
        assert cfg.weights.update_weight_delta_checksum == algo


def test_adler32_catches_a_flipped_byte(tmp_path: Path) -> None:
    s0 = _state()
    write_version(tmp_path, 0, s0.items(), baseline=None, checksum="adler32")
    d = write_version(tmp_path, 1, _step(s0, 1).items(), baseline=s0, checksum="adler32")
    m = json.loads((d / dd.DELTA_MANIFEST).read_text())
    entry = next(e for e in m["tensors"] if e["name"] == "w")
    assert entry["delta_checksum"].startswith("adler32:") and len(entry["delta_checksum"]) == len("adler32:") + 8
    f = d / entry["file"]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match="corrupted"):
        apply_delta_dir(d, s0, current_version=0)


def test_manifest_written_with_the_old_xxh3_name_still_applies(tmp_path: Path) -> None:
    """Versions on disk from before the rename name xxh3-128 ``xxh3``; an engine still applies them."""
    s0, s1 = _state(), _step(_state(), 1)
    d = write_version(tmp_path, 1, s1.items(), baseline=s0, checksum="xxh3-128")
    mf = d / dd.DELTA_MANIFEST
    m = json.loads(mf.read_text())
    m["checksum"] = "xxh3"
    for e in m["tensors"]:
        for k in ("delta_checksum", "result_checksum"):
            if e.get(k):
                e[k] = e[k].replace("xxh3-128:", "xxh3:")
    mf.write_text(json.dumps(m))
    assert _equal(apply_delta_dir(d, s0, current_version=0), s1)
    m["checksum"] = "md5"
    mf.write_text(json.dumps(m))
    with pytest.raises(DeltaError, match="checksum 'md5'"):
        apply_delta_dir(d, s0, current_version=0)
