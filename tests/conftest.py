"""Shared fixtures: pools are always closed, so no thread outlives its test."""

import pytest

from tether.loop.fakes import FakePool


@pytest.fixture
def make_pool():
    pools: list[FakePool] = []

    def make(**kw) -> FakePool:
        pool = FakePool(**kw)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A real 0.1M-parameter Qwen3 model and char tokenizer, built once per test session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from tether.data.tiny_model import init_model

    hf_logging.disable_progress_bar()
    path = tmp_path_factory.mktemp("models") / "tiny"
    init_model(path, arch="qwen3", size="tiny", seed=0)
    return path
