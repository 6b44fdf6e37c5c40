"""A packed micro-batch run as right-padded rows (``batching.padded_rows``, the trainer's SDPA path for many
short samples) gives the packed row's log-probs and entropy."""

from __future__ import annotations

import torch

from miles.trainer.batching import SampleData, pack, padded_rows


def _data(seed: int = 0) -> list[SampleData]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(9):
        n = int(torch.randint(3, 12, (1,), generator=gen))
        r = int(torch.randint(1, n, (1,), generator=gen))
        out.append(SampleData(tokens=torch.randint(4, 90, (n,), generator=gen), response_length=r,
                              loss_mask=torch.ones(r)))
    return out


def test_padded_rows_layout():
    data = _data()
    mb = pack(data, [2, 0, 5, 7])
    ids, pos, index = padded_rows(mb, pad_token_id=0)
    width = max(data[i].length for i in (2, 0, 5, 7))
    assert ids.shape == pos.shape == (4, width)
    for row, sid in enumerate((2, 0, 5, 7)):
        n = data[sid].length
        assert torch.equal(ids[row, :n], data[sid].tokens) and bool((ids[row, n:] == 0).all())
        assert torch.equal(pos[row], torch.arange(width))
    # the same tokens are predicted: the token after each logit position is the target
    assert torch.equal(ids.flatten()[index + 1], mb.targets)


def test_padded_rows_match_the_packed_row(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from miles.trainer.modeling import PolicyModel

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model = PolicyModel(hf).eval()
    mb = pack(_data(1), list(range(9)))
    ids, pos, index = padded_rows(mb)
    with torch.no_grad():
        lp_packed, ent_packed = model(mb.input_ids, mb.position_ids, mb.logit_index, mb.targets, mb.cu_seqlens,
                                      mb.max_seqlen, temperature=0.7, with_entropy=True)
        lp_rows, ent_rows = model(ids, pos, index, mb.targets, mb.cu_seqlens, mb.max_seqlen, temperature=0.7,
                                  with_entropy=True)
    # fp32, padded rows against one packed row: measured 4.8e-7 (CPU, 2026-12-07)
    torch.testing.assert_close(lp_rows, lp_packed, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_rows, ent_packed, rtol=0, atol=1e-6)
