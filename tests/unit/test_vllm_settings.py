"""What the vLLM engine decides without vLLM: which versions it accepts, and tied weight names."""

import pytest

from tether.errors import ConfigError
from tether.rollout.engines.vllm.section import require_processed_logprobs as _require_processed_logprobs


@pytest.mark.parametrize("version", ["0.10.2", "0.10.2.dev5+g1234abc", "0.32.0", "1.0.0rc1"])
def test_a_vllm_with_processed_log_probs_is_accepted(version):
    _require_processed_logprobs(version)


@pytest.mark.parametrize("version", ["0.10.1", "0.9.2", "0.6.3.post1"])
def test_an_older_vllm_is_refused_saying_why(version):
    with pytest.raises(ConfigError, match=r"cannot return the log-probs of the distribution it samples from"):
        _require_processed_logprobs(version)


def test_tied_output_layers_are_named_after_the_tensor_they_share(tiny_model_dir):
    from tether.rollout.engines.vllm.engine import tied_names

    assert tied_names(str(tiny_model_dir)) == {"lm_head.weight": "model.embed_tokens.weight"}
