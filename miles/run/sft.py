"""Supervised fine-tuning data (``--loss-type sft_loss``): training samples straight from the prompt data.

Each row's prompt (rendered and tokenized by :class:`~miles.rollout.data.PromptDataset`, so
``--apply-chat-template`` applies as for RL) is followed by its target response, the row's
``--label-key`` field tokenized as-is plus the tokenizer's end-of-sequence token. The loss covers the
response tokens only (the trainer's ``loss_mask``). No engine is needed: SFT runs with
``--debug-train-only`` or alongside engines (then ``--eval-prompt-data`` measures the model).

    source = SFTSource(data_source, tokenizer, cfg.data)
    groups = source.next_rollout(rollout_id)          # list[list[Sample]], one sample per group

Chat ``messages`` rows (the loss on every assistant turn), the way Miles's SFT launchers pass them, go
through ``--rollout-function-path miles.rollout.sft_rollout.generate_rollout`` instead
(:mod:`miles.rollout.sft_rollout`); this source then is not used.
"""

from __future__ import annotations

import time
from typing import Any

from miles.config.base import ConfigError
from miles.config.data import DataConfig
from miles.rollout.data import DataSource
from miles.types import Sample, SampleStatus


class SFTSource:
    def __init__(self, data_source: DataSource, tokenizer: Any, data: DataConfig) -> None:
        if not data.label_key:
            raise ConfigError("--loss-type sft_loss trains on each row's prompt followed by its target response: pass "
                              "--label-key naming the field that holds the response (e.g. --label-key response).")
        if tokenizer.eos_token_id is None:
            raise ConfigError("--loss-type sft_loss appends the end-of-sequence token to each response, but the "
                              "tokenizer of --hf-checkpoint has no eos_token.")
        self.data_source, self.tokenizer, self.data = data_source, tokenizer, data
        self._cache: dict[int, list[int]] = {}

    def _response_ids(self, index: int, label: Any) -> list[int]:
        ids = self._cache.get(index)
        if ids is None:
            if not isinstance(label, str):
                raise ConfigError(f"--loss-type sft_loss: row {index} of {self.data_source.dataset.path} has "
                                  f"{type(label).__name__} under --label-key {self.data.label_key!r}; the target "
                                  "response must be a string.")
            ids = list(self.tokenizer(label, add_special_tokens=False)["input_ids"]) + [self.tokenizer.eos_token_id]
            self._cache[index] = ids
        return ids

    def next_rollout(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float]]:
        t0 = time.monotonic()
        batch = self.data_source.next_batch(self.data.rollout_batch_size)
        groups = []
        for g, item in enumerate(batch):
            resp = self._response_ids(item.index, item.label)
            groups.append([Sample(
                group_index=g, index=g, rollout_id=rollout_id, prompt=item.prompt,
                tokens=list(item.prompt_ids) + resp, response=str(item.label), response_length=len(resp),
                loss_mask=[1] * len(resp), label=item.label, status=SampleStatus.COMPLETED,
                metadata=dict(item.metadata))])
        lengths = [len(grp[0].tokens) - len(batch[i].prompt_ids) for i, grp in enumerate(groups)]
        return groups, {
            "rollout/raw_reward": float("nan"),  # SFT has no reward; evaluation measures the model
            "rollout/response_len": sum(lengths) / max(1, len(lengths)),
            "rollout/num_samples": float(len(groups)),
            "rollout/epoch": float(self.data_source.epoch),
            "perf/rollout_time": time.monotonic() - t0,
        }
