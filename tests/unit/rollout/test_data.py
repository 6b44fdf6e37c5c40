"""Prompt data: JSONL and Parquet, keys, chat template, max prompt length, shuffle, resume, bad input."""

from __future__ import annotations

import json

import pytest

from miles.config import ConfigError, parse_args
from miles.config.eval_datasets import resolve_eval_datasets
from miles.rollout.data import DataError, DataSource, PromptDataset, load_eval_datasets, parse_eval_prompt_data
from miles.utils.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def cfg(*extra: str):
    return parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", *extra], validate=False)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [{"input": f"{a}+{a}=", "label": str(2 * a), "metadata": {"k": a}} for a in range(10)]


def test_jsonl_keys_and_token_ids(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", ROWS)
    c = cfg("--label-key", "label")
    ds = PromptDataset(p, tok, c.data, seed=1)
    assert len(ds) == 10 and ds.num_rows == 10
    item = ds[3]
    assert item.prompt == "3+3=" and item.label == "6" and item.metadata == {"k": 3}
    assert item.prompt_ids == tok("3+3=", add_special_tokens=False)["input_ids"]
    assert tok.decode(item.prompt_ids) == "3+3="


def test_parquet_with_custom_keys(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"q{i}", "answer": i, "extra": json.dumps({"src": "x"})} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    c = cfg("--input-key", "question", "--label-key", "answer", "--metadata-key", "extra")
    ds = PromptDataset(tmp_path / "d.parquet", tok, c.data)
    assert [it.prompt for it in ds.items] == [f"q{i}" for i in range(5)]
    assert ds[4].label == 4 and ds[4].metadata == {"src": "x"}


def test_chat_template_is_the_tokenizers_and_explicit(tmp_path, tok):
    rows = [{"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]},
            {"input": "1+1="}]
    p = write_jsonl(tmp_path / "chat.jsonl", rows)
    ds = PromptDataset(p, tok, cfg("--apply-chat-template").data)
    want0 = tok.apply_chat_template(rows[0]["input"], tokenize=False, add_generation_prompt=True)
    assert tok.decode(ds[0].prompt_ids) == want0
    assert want0.endswith("<|im_start|>assistant\n") and "be brief" in want0
    # a string prompt becomes one user message
    assert tok.decode(ds[1].prompt_ids) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    # list-shaped prompt without the flag: an error naming the flag, with file:line
    with pytest.raises(DataError, match=r"chat\.jsonl:1: .*--apply-chat-template is not set.*Add --apply-chat-template"):
        PromptDataset(p, tok, cfg().data)


def test_max_prompt_len_drops_and_counts(tmp_path, tok, caplog):
    rows = [{"input": "x" * n} for n in (3, 10, 5, 20, 8)]
    p = write_jsonl(tmp_path / "len.jsonl", rows)
    with caplog.at_level("WARNING", logger="miles"):
        ds = PromptDataset(p, tok, cfg("--rollout-max-prompt-len", "8").data)
    assert [len(it.prompt_ids) for it in ds.items] == [3, 5, 8]
    assert ds.num_dropped_too_long == 2
    assert "dropped 2 of 5 prompts longer than --rollout-max-prompt-len 8" in caplog.text
    with pytest.raises(DataError, match="no usable prompts .5 longer than --rollout-max-prompt-len 1"):
        PromptDataset(p, tok, cfg("--rollout-max-prompt-len", "1").data)


def test_malformed_line_names_file_and_line(tmp_path, tok):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input": "a"}\n\n{"input": "b"}\n{"input": "c",\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:4: not valid JSON"):
        PromptDataset(p, tok, cfg().data)
    # a truncated last line (with or without its newline): the column where the line ends, not column 1 of a next line
    for ending in ("\n", "\r\n", ""):
        p.write_text('{"input": "a"}\n{"input": "b", "label": "c' + ending)
        with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON \(Unterminated string starting at column 25\)"):
            PromptDataset(p, tok, cfg().data)
        p.write_text('{"input": "a"}\n{"input": "b"' + ending)
        with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON \(Expecting ',' delimiter at column 14\)"):
            PromptDataset(p, tok, cfg().data)
    p.write_text('{"input": "a"}\n["not", "an", "object"]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: expected a JSON object per line, got list"):
        PromptDataset(p, tok, cfg().data)


def test_missing_key_names_key_and_keys_present(tmp_path, tok):
    p = write_jsonl(tmp_path / "k.jsonl", [{"input": "a", "label": 1}, {"prompt": "b", "answer": 2}])
    with pytest.raises(DataError) as e:
        PromptDataset(p, tok, cfg().data)
    msg = str(e.value)
    assert "k.jsonl:2" in msg and "missing key 'input'" in msg and "--input-key" in msg and "['answer', 'prompt']" in msg
    # the first row without the key: maybe the wrong key, so suggest the flag
    p = write_jsonl(tmp_path / "k.jsonl", [{"input": "b"}])
    with pytest.raises(DataError, match=r"k\.jsonl:1: missing key 'label' \(set by --label-key\); keys present: "
                                        r"\['input'\]\. Pass --label-key with one of them"):
        PromptDataset(p, tok, cfg("--label-key", "label").data)


def test_label_missing_in_one_row_names_that_row_not_the_flag(tmp_path, tok):
    rows = [{"input": "a", "label": 1}, {"input": "b", "label": 2}, {"input": "c"}]
    p = write_jsonl(tmp_path / "k.jsonl", rows)
    with pytest.raises(DataError) as e:
        PromptDataset(p, tok, cfg("--label-key", "label").data)
    msg = str(e.value)
    assert msg.startswith(f"{p}:3: missing key 'label' (set by --label-key) in this row, though the 2 rows before "
                          f"have it; keys present: ['input']. Add 'label' to this row or remove the row.")
    assert "Pass --label-key" not in msg
    p = write_jsonl(tmp_path / "n.jsonl", [{"input": "a", "label": 1}, {"input": "b", "label": None}])
    with pytest.raises(DataError, match=r"n\.jsonl:2: key 'label' \(set by --label-key\) is null in this row"):
        PromptDataset(p, tok, cfg("--label-key", "label").data)


def test_non_utf8_byte_names_file_and_line(tmp_path, tok):
    p = tmp_path / "latin.jsonl"
    p.write_bytes(b'{"input": "a"}\n{"input": "b"}\n{"input": "caf' + b"\xe9" + b'"}\n')
    with pytest.raises(DataError) as e:
        PromptDataset(p, tok, cfg().data)
    assert str(e.value).startswith(f"{p}:3: not valid UTF-8 (byte 0xe9 at byte 15 of the line); save --prompt-data as UTF-8")
    assert e.value.__cause__ is None and e.value.__suppress_context__  # one line, no chained decode traceback
    # an evaluation file is named by the flag that gave it, not as --prompt-data
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    c = cfg("--prompt-data", str(good), "--eval-prompt-data", "aime", str(p))
    with pytest.raises(DataError) as e:
        load_eval_datasets(resolve_eval_datasets(c.eval, c.data, c.rollout), c.eval, c.data, tok)
    assert str(e.value).startswith(f"{p}:3: not valid UTF-8 (byte 0xe9 at byte 15 of the line); save --eval-prompt-data "
                                   "aime as UTF-8"), str(e.value)
    # a UTF-8 byte-order mark on the first line is fine
    p.write_bytes(b"\xef\xbb\xbf" + b'{"input": "a"}\n{"input": "b"}\n')
    assert [it.prompt for it in PromptDataset(p, tok, cfg().data).items] == ["a", "b"]


def test_oversized_record_is_dropped_unparsed_naming_file_and_line(tmp_path, tok, caplog):
    p = tmp_path / "big.jsonl"
    # line 2 is 3 MB and not even valid JSON: parsing it would raise, so passing proves it was never parsed
    p.write_text('{"input": "a"}\n{"input": "' + "x" * 3_000_000 + '\n{"input": "b"}\n')
    with caplog.at_level("WARNING", logger="miles"):
        ds = PromptDataset(p, tok, cfg("--rollout-max-prompt-bytes", "1000000").data)
    assert [it.prompt for it in ds.items] == ["a", "b"] and ds.num_dropped_too_big == 1 and ds.num_rows == 3
    assert f"{p}:2: record of 3000012 bytes dropped unparsed: larger than --rollout-max-prompt-bytes 1000000" in caplog.text
    assert "dropped 1 of 3 records larger than --rollout-max-prompt-bytes 1000000" in caplog.text
    # the default limit (8 MiB) drops a 9 MB line too; a rendered prompt over the limit (Parquet) is dropped
    p.write_text('{"input": "a"}\n{"input": "' + "y" * 9_000_000 + '"}\n')
    assert PromptDataset(p, tok, cfg().data).num_dropped_too_big == 1
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"input": "z" * 2000}, {"input": "ok"}]), tmp_path / "big.parquet")
    ds = PromptDataset(tmp_path / "big.parquet", tok, cfg("--rollout-max-prompt-bytes", "1000").data)
    assert [it.prompt for it in ds.items] == ["ok"] and ds.num_dropped_too_big == 1
    assert "big.parquet:row 0: rendered prompt of 2000 bytes dropped before tokenizing" in caplog.text
    with pytest.raises(DataError, match=r"no usable prompts \(1 longer than --rollout-max-prompt-len 1; "
                                        r"1 larger than --rollout-max-prompt-bytes 10\)"):
        PromptDataset(tmp_path / "big.parquet", tok, cfg("--rollout-max-prompt-bytes", "10",
                                                         "--rollout-max-prompt-len", "1").data)
    with pytest.raises(ConfigError, match="--rollout-max-prompt-bytes must be a positive number of bytes, got 0"):
        PromptDataset(p, tok, cfg("--rollout-max-prompt-bytes", "0").data)


class _SpyTokenizer:
    """The real tokenizer, recording the longest text it was asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, texts, **kwargs):
        self.longest = max([self.longest, *map(len, texts)])
        return self.tok(texts, **kwargs)


def test_max_prompt_len_drops_a_huge_prompt_without_tokenizing_it_whole(tmp_path, tok):
    p = write_jsonl(tmp_path / "huge.jsonl", [{"input": "1+1="}, {"input": "1 2 " * 500_000}, {"input": "2+2="}])
    spy = _SpyTokenizer(tok)
    ds = PromptDataset(p, spy, cfg("--rollout-max-prompt-len", "64").data)
    assert [it.prompt for it in ds.items] == ["1+1=", "2+2="] and ds.num_dropped_too_long == 1
    assert spy.longest == (64 + 2) * 32  # only the prefix of the 2 MB prompt was tokenized
    # a long text of long tokens still passes through the whole tokenizer and is kept when it fits
    text = "word" * 3000
    p = write_jsonl(tmp_path / "fits.jsonl", [{"input": text}])
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert len(PromptDataset(p, tok, cfg("--rollout-max-prompt-len", str(n)).data)[0].prompt_ids) == n


def test_other_bad_input(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset(tmp_path / "nope.jsonl", tok, cfg().data)
    (tmp_path / "d.csv").write_text("input\na\n")
    with pytest.raises(DataError, match="unknown format"):
        PromptDataset(tmp_path / "d.csv", tok, cfg().data)
    p = write_jsonl(tmp_path / "m.jsonl", [{"input": "a", "metadata": [1]}])
    with pytest.raises(DataError, match="m.jsonl:1: 'metadata' .--metadata-key. must be an object"):
        PromptDataset(p, tok, cfg().data)
    p = write_jsonl(tmp_path / "n.jsonl", [{"input": 5}])
    with pytest.raises(DataError, match="n.jsonl:1: the prompt under 'input' must be a string"):
        PromptDataset(p, tok, cfg().data)


def _order(src: DataSource, n_batches: int, bs: int) -> list[int]:
    return [it.index for _ in range(n_batches) for it in src.next_batch(bs)]


def test_shuffle_is_seeded_per_epoch_and_reproducible(tmp_path, tok):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tok, cfg().data)
    a = _order(DataSource(ds, shuffle=True, seed=7), 5, 4)  # 20 prompts: 2 epochs, batches cross the boundary
    b = _order(DataSource(ds, shuffle=True, seed=7), 5, 4)
    c = _order(DataSource(ds, shuffle=True, seed=8), 5, 4)
    assert a == b and a != c
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:]) == list(range(10))
    assert a[:10] != a[10:], "each epoch gets its own permutation"
    assert _order(DataSource(ds, shuffle=False), 3, 4) == [*range(10), 0, 1]


def test_state_resume_continues_exact_order(tmp_path, tok):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tok, cfg().data)
    full = DataSource(ds, shuffle=True, seed=3)
    expect = _order(full, 9, 3)
    first = DataSource(ds, shuffle=True, seed=3)
    head = _order(first, 4, 3)
    given_back = first.next_batch(2)  # e.g. aborted surplus of dynamic sampling
    first.give_back(given_back)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-able
    assert state["epoch"] == 1 and state["offset"] == 4 and state["buffer"] == [it.index for it in given_back]
    resumed = DataSource(ds, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert head + _order(resumed, 5, 3) == expect
    with pytest.raises(ValueError, match="--rollout-seed 3 .*now --rollout-seed 4"):
        DataSource(ds, shuffle=True, seed=4).load_state_dict(state)
    small = PromptDataset(write_jsonl(tmp_path / "s.jsonl", ROWS[:5]), tok, cfg().data)
    with pytest.raises(ValueError, match="covers 10 prompts but .* now has 5"):
        DataSource(small, shuffle=True, seed=3).load_state_dict(state)


def test_num_rollout_from_epochs_and_eval_pairs(tmp_path, tok):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tok, cfg().data)
    assert DataSource(ds).num_rollout_from_epochs(3, 4) == 6
    with pytest.raises(ConfigError, match="--rollout-batch-size 11 is larger than the prompt data"):
        DataSource(ds).num_rollout_from_epochs(1, 11)
    assert parse_eval_prompt_data(["a", "x.jsonl", "b", "y.jsonl"]) == [("a", "x.jsonl"), ("b", "y.jsonl")]
    assert parse_eval_prompt_data(["only.jsonl"]) == [("aime", "only.jsonl")]  # Miles's legacy single PATH
    with pytest.raises(ConfigError, match="NAME PATH pairs"):
        parse_eval_prompt_data(["a", "x.jsonl", "y.jsonl"])
    c = cfg("--eval-prompt-data", "tiny", str(tmp_path / "d.jsonl"))
    evals = load_eval_datasets(resolve_eval_datasets(c.eval, c.data, c.rollout), c.eval, c.data, tok)
    assert list(evals) == ["tiny"] and len(evals["tiny"]) == 10
