"""Held-out evaluation: greedy pass@1 and k samples per prompt, on a real tiny model."""

import pytest

torch = pytest.importorskip("torch")

from tether.families.text.evaluate import Evaluator  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402
from tether.vocabulary import Example, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class EveryThird:
    """A scorer that calls every third completion it sees fully right and records what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, example: Example, completion: str) -> float:
        self.seen.append((example.prompt, completion))
        return 1.0 if len(self.seen) % 3 == 0 else 0.25


def evaluator(model_dir, score, num_samples):
    model, tok = load_causal_lm(model_dir)
    examples = [Example(prompt=p, answer="") for p in ("1+1=", "22+3=", "rev abc=", "sort cab=")]
    return Evaluator(model, tok, examples, score, stop_text="\n", num_samples=num_samples,
                     params=SamplingParams(max_new_tokens=4, temperature=1.0), seed=0)


def test_k_samples_per_prompt_give_mean_at_k_and_pass_at_k(tiny_model_dir):
    score = EveryThird()
    metrics = evaluator(tiny_model_dir, score, num_samples=3)(step=10)
    # 4 greedy calls (the 3rd right), then 12 sampled ones, prompt-major: calls 5–7 are prompt 0's
    # (call 6 right), 8–10 prompt 1's (9), 11–13 prompt 2's (12), 14–16 prompt 3's (15)
    assert [p for p, _ in score.seen[4:]] == [p for p in ("1+1=", "22+3=", "rev abc=", "sort cab=")
                                             for _ in range(3)]
    assert metrics["eval/pass_at_1"] == pytest.approx(1 / 4)
    assert metrics["eval/sampled_pass_at_1"] == pytest.approx(4 / 12)
    assert metrics["eval/sampled_reward_mean"] == pytest.approx((4 * 1.0 + 8 * 0.25) / 12)
    assert metrics["eval/pass_at_k"] == 1.0 and metrics["eval/num_samples"] == 3.0
    assert metrics["eval/examples"] == 4.0


def test_one_sample_per_prompt_reports_no_pass_at_k(tiny_model_dir):
    metrics = evaluator(tiny_model_dir, EveryThird(), num_samples=1)(step=0)
    assert "eval/pass_at_k" not in metrics
    # calls 1–4 greedy (3 right), 5–8 sampled (6 right)
    assert metrics["eval/sampled_pass_at_1"] == pytest.approx(1 / 4)
