"""Reward functions: built-ins, user files, and every way loading or calling one can go wrong."""

import sys

import pytest

from tether.data.rewards import load_reward, scorer
from tether.errors import ConfigError, RewardError
from tether.vocabulary import Example

EX = Example("What is 6*7?", "42", fields={"source": "test"})


def test_builtins():
    assert scorer("exact_match")(EX, "42\nbecause") == 1.0
    assert scorer("exact_match")(EX, "41") == 0.0
    assert scorer("numeric_match")(EX, "The answer is 42.0") == 1.0
    assert scorer("numeric_match")(EX, "1,042") == 0.0
    assert scorer("numeric_match")(EX, "no number") == 0.0
    assert scorer("task", task="arithmetic")(Example("1+2=", "3"), "3") == 1.0


def test_math_reward_when_installed():
    pytest.importorskip("math_verify")
    s = scorer("math")
    assert s(Example("q", "\\frac{1}{2}"), "The answer is $0.5$") == 1.0
    assert s(Example("q", "\\frac{1}{2}"), "The answer is $0.25$") == 0.0


def test_math_reward_without_the_extra_says_which_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ConfigError, match=r"pip install 'tether\[math\]'"):
        load_reward("math")


def test_user_reward_receives_every_argument(tmp_path):
    (tmp_path / "r.py").write_text(
        "def reward(prompt, completion, answer, fields):\n"
        "    return float(completion.strip() == answer) + (0.5 if fields['source'] == 'test' else 0)\n"
    )
    assert scorer(f"{tmp_path / 'r.py'}:reward")(EX, "42") == 1.5


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        (None, "missing.py:reward", "reward function file 'missing.py' does not exist"),
        ("def other(p, c, a, f):\n    return 1.0\n", "{}:reward",
         "defines no 'reward'; its functions are: other"),
        ("def reward(prompt, completion):\n    return 1.0\n", "{}:reward",
         "must accept (prompt, completion, answer, fields) -> float; its signature is (prompt, completion)"),
        ("import nonexistent_module_xyz\n", "{}:reward", "failed to import: ModuleNotFoundError"),
        (None, "no_colon", "unknown reward 'no_colon'"),
        (None, "task", "reward.function=task needs a built-in data.task"),
    ],
)
def test_bad_reward_specs(tmp_path, source, spec, message):
    path = tmp_path / "r.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(ConfigError) as info:
        load_reward(spec.format(path))
    assert message in str(info.value)


@pytest.mark.parametrize("value", ["float('nan')", "float('inf')", "None", "'1.0'"])
def test_non_finite_or_non_numeric_returns_are_errors(tmp_path, value):
    (tmp_path / "r.py").write_text(f"def reward(p, c, a, f):\n    return {value}\n")
    with pytest.raises(RewardError, match="must return a finite number"):
        scorer(f"{tmp_path / 'r.py'}:reward")(EX, "42")


@pytest.mark.parametrize(("value", "expected"), [
    ("numpy.float32(1.0)", 1.0), ("numpy.int64(2)", 2.0), ("numpy.float64(-0.5)", -0.5),
    ("numpy.bool_(True)", 1.0),
    ("numpy.array(0.25)", 0.25), ("torch.tensor(0.75)", 0.75), ("numpy.float32('nan')", None),
    ("numpy.array([1.0, 2.0])", None), ("torch.tensor([1.0])", None)])
def test_numpy_and_torch_numbers_are_numbers(tmp_path, value, expected):
    (tmp_path / "r.py").write_text(f"import numpy, torch\ndef reward(p, c, a, f):\n    return {value}\n")
    score = scorer(f"{tmp_path / 'r.py'}:reward")
    if expected is None:  # not one finite number
        with pytest.raises(RewardError, match="must return a finite number"):
            score(EX, "42")
    else:
        assert score(EX, "42") == expected and type(score(EX, "42")) is float


def test_a_reward_too_large_to_train_on_names_the_function_and_the_value(tmp_path):
    (tmp_path / "r.py").write_text("def reward(p, c, a, f):\n    return 1e300\n")
    with pytest.raises(RewardError, match=r"reward function .*r\.py:reward returned 1e\+300 .*±1e\+06"):
        scorer(f"{tmp_path / 'r.py'}:reward")(EX, "42")


def test_bool_counts_as_zero_or_one(tmp_path):
    (tmp_path / "r.py").write_text("def reward(p, c, a, f):\n    return c == a\n")
    assert scorer(f"{tmp_path / 'r.py'}:reward")(EX, "42") == 1.0


def test_several_rewards_are_summed_with_their_weights_and_each_part_is_reported():
    from tether.config import load_config
    from tether.families.text import FAMILY

    cfg = load_config(None, ["data.task=arithmetic", "reward.functions=[task, exact_match]",
                             "reward.weights=[1.0, 0.5]"])
    score = FAMILY.scorer(cfg)
    right, wrong = Example("1+2=", "3"), Example("1+2=", "3")
    assert score(right, "3\n") == pytest.approx(1.0 + 0.5 * 1.0)
    assert score(wrong, "4\n") == pytest.approx(0.1 + 0.5 * 0.0)  # the task's format credit, no match
    assert score.take_parts() == pytest.approx({"reward/part_0_mean": 0.55, "reward/part_1_mean": 0.5})
    assert score.take_parts() == {}  # taken


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward.function=exact_match", "reward.functions=[exact_match]"], "are both set"),
    (["reward.functions=[exact_match, task]", "reward.weights=[1.0]"], "1 weights for 2"),
    (["data.task=", "data.dataset=x.jsonl", "reward.functions=[task]"], "needs|scores with a built-in task"),
])
def test_weighted_rewards_refuse_what_cannot_be_meant(overrides, message):
    from tether.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_batched_reward_scores_the_whole_batch_in_one_call_and_is_checked_per_sample():
    from tether.data.rewards import Scorer, WeightedScorer, batched, score_all

    calls = []

    @batched
    def lengths(prompts, completions, answers, fields):
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    score = Scorer(lengths, "lengths")
    pairs = [(Example("p", "a"), "x" * k) for k in range(1, 5)]
    assert score_all(score, pairs) == ([1.0, 2.0, 3.0, 4.0], 0) and calls == [4]  # one call
    assert score(Example("p", "a"), "xyz") == 3.0  # a batch of one where scoring goes sample by sample
    both = WeightedScorer([score, Scorer(lambda p, c, a, f: 1.0, "one")], [0.5, 2.0])
    assert both.many([e for e, _ in pairs], [c for _, c in pairs]) == [2.5, 3.0, 3.5, 4.0]

    @batched
    def short(prompts, completions, answers, fields):
        return [1.0]

    with pytest.raises(RewardError, match="returned 1 rewards for 4 samples"):
        score_all(Scorer(short, "short"), pairs)
    assert score_all(Scorer(short, "short"), pairs, on_error="zero") == ([0.0] * 4, 4)

    @batched
    def nan(prompts, completions, answers, fields):
        return [1.0, float("nan"), 1.0, 1.0]

    with pytest.raises(RewardError, match="finite"):
        score_all(Scorer(nan, "nan"), pairs)
