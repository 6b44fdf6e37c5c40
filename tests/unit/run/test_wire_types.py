"""Payloads with a valid checksum but wrong field types, or a deeply nested header, are SampleWireError."""

from __future__ import annotations

import json
import struct

import pytest

from miles.run import wire
from miles.run.wire import SampleWireError, decode_samples, encode_samples
from miles.types import Sample


def _sample() -> Sample:
    return Sample(index=0, prompt="1+1=", tokens=[1, 2, 3], response="2", response_length=1, reward=1.0)


@pytest.mark.parametrize("field,value", [("reward", "abc"), ("index", "0"), ("response_length", 1.5),
                                         ("metadata", [1]), ("weight_version", True)])
def test_checksummed_payload_with_a_wrong_type_is_refused(monkeypatch, field, value):
    real = wire._sample_json

    def tampered(i, s):
        d = real(i, s)
        d[field] = value
        return d

    monkeypatch.setattr(wire, "_sample_json", tampered)
    data = encode_samples([_sample()])  # the checksum covers the tampered JSON
    monkeypatch.setattr(wire, "_sample_json", real)
    with pytest.raises(SampleWireError, match=f"wrong type: sample record 0 field '{field}'"):
        decode_samples(data)


def test_deeply_nested_header_is_a_wire_error_not_recursion():
    header = ("[" * 100_000 + "]" * 100_000).encode()
    data = struct.pack("<Q", len(header)) + header
    with pytest.raises(SampleWireError, match="bad header: the safetensors header is not valid JSON"):
        decode_samples(data)


def test_good_payload_still_decodes():
    s = _sample()
    out = decode_samples(encode_samples([s]))
    assert out[0].reward == 1.0 and out[0].tokens == [1, 2, 3] and json.dumps(out[0].metadata) == "{}"
