"""The model every vLLM test runs, built once for the folder."""

import pytest


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The demo's model (Qwen3, ~3.2M parameters, character tokenizer), without its warm start."""
    pytest.importorskip("vllm")
    from tether.data.tiny_model import init_model

    path = tmp_path_factory.mktemp("models") / "demo-small"
    init_model(path, arch="qwen3", size="small", seed=0)
    return path
