"""Fixtures for the embedded engine's tests: a tiny model with peaked logits and real server processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.engine.testing import build_engine_model


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory) -> Path:
    return build_engine_model(tmp_path_factory.mktemp("engine_model"))


@pytest.fixture(scope="session")
def hf_reference(engine_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine_model).eval()
