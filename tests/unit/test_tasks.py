"""Built-in tasks: determinism, disjoint splits, and verifiers on known answers."""

import pytest

from tether import registry
from tether.data.tasks import FORMAT_CREDIT, evaluate_expression, get_task, split_of
from tether.errors import ConfigError
from tether.vocabulary import Example

TEXT_TASKS = [n for n in registry.tasks.builtins if registry.tasks.get(n).family == "text"]


@pytest.mark.parametrize("name", sorted(TEXT_TASKS))
def test_generation_is_deterministic_in_the_seed(name):
    task = get_task(name)
    a = task.examples("train", 50, seed=3)
    b = task.examples("train", 50, seed=3)
    c = task.examples("train", 50, seed=4)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    assert len({e.prompt for e in a}) == 50  # distinct within a split


@pytest.mark.parametrize("name", sorted(TEXT_TASKS))
def test_train_and_eval_splits_are_disjoint_whatever_the_seeds(name):
    task = get_task(name)
    train = {e.prompt for seed in (0, 1) for e in task.examples("train", 400, seed=seed)}
    held_out = {e.prompt for seed in (0, 5) for e in task.examples("eval", 40, seed=seed)}
    assert not train & held_out
    assert all(split_of(p) == "eval" for p in held_out)


@pytest.mark.parametrize("name", sorted(TEXT_TASKS))
def test_every_demonstration_earns_full_reward_and_junk_earns_none(name):
    task = get_task(name)
    for d in task.difficulties:
        for ex in task.examples("train", 20, seed=0, difficulty=d):
            assert task.verify(ex.target, ex) == 1.0
            assert task.verify(ex.target + "\nextra lines are ignored", ex) == 1.0
            assert task.verify("???", ex) == 0.0


def test_arithmetic_known_answers_and_format_credit():
    task = get_task("arithmetic")
    ex = Example("37+45=", "82")
    assert task.verify("82", ex) == 1.0
    assert task.verify(" 82 ", ex) == 1.0
    assert task.verify("83", ex) == FORMAT_CREDIT  # a number, but wrong
    assert task.verify("eighty-two", ex) == 0.0
    sub = Example("12-40=", "-28")
    assert task.verify("-28", sub) == 1.0
    assert task.verify("-27", sub) == FORMAT_CREDIT
    assert all(e.prompt.count("+") + e.prompt.count("-") == 1
               for e in task.examples("train", 30, difficulty=3))


def test_countdown_checks_numbers_and_target_without_eval():
    task = get_task("countdown")
    ex = Example("3 4 7>25:", "25", fields={"numbers": [3, 4, 7], "target": 25})
    assert task.verify("3*7+4", ex) == 1.0
    assert task.verify("(4+3)*7-24", ex) == FORMAT_CREDIT  # 24 is not an available number
    assert task.verify("7*7", ex) == FORMAT_CREDIT          # 7 used twice
    assert task.verify("3+4+7", ex) == FORMAT_CREDIT        # well formed, wrong value
    assert task.verify("__import__('os')", ex) == 0.0
    assert evaluate_expression("8/(3-3)") is None
    assert evaluate_expression("7/2*2")[0] == 7  # exact rational arithmetic
    assert evaluate_expression("2**3") is None    # only + - * /


def test_string_tasks_known_answers():
    rev, srt = get_task("reverse"), get_task("sort")
    ex = Example("rev abcd=", "dcba", fields={"word": "abcd"})
    assert rev.verify("dcba", ex) == 1.0
    assert rev.verify("abdc", ex) == FORMAT_CREDIT  # the right letters in the wrong order
    assert rev.verify("xyz", ex) == 0.0
    ex = Example("sort dbca=", "abcd", fields={"word": "dbca"})
    assert srt.verify("abcd", ex) == 1.0
    assert all(len(e.fields["word"]) == 6 for e in rev.examples("train", 10, difficulty=6))


def test_repeat_answers_have_a_long_tail_of_lengths():
    """Lengths geometric with mean about the difficulty, capped at 8×: most answers short, a few
    several times the mean — what makes draining wait behind the slowest sequence."""
    import random
    import statistics

    task = get_task("repeat")
    rng = random.Random(0)
    lengths = [len(task.draw(rng, 8).answer) for _ in range(5000)]
    assert statistics.fmean(lengths) == pytest.approx(8, rel=0.05)
    assert min(lengths) == 1 and max(lengths) > 4 * 8 and max(lengths) <= 64
    # a split holds distinct prompts: short ones repeat more often, so its mean is a little longer
    split = [len(e.answer) for e in task.examples("train", 1000, seed=0, difficulty=8)]
    assert 8 <= statistics.fmean(split) <= 10
    assert statistics.median(split) < statistics.fmean(split)  # skewed: a long right tail
    ex = Example("rep ab 5=", "ababa", fields={"pattern": "ab", "length": 5})
    assert task.verify("ababa", ex) == 1.0
    assert task.verify("abab", ex) == FORMAT_CREDIT  # the pattern, the wrong length
    assert task.verify("abba", ex) == 0.0
    assert task.verify("", ex) == 0.0


def test_a_question_earns_full_reward_for_the_bare_sum_and_half_for_it_among_words():
    task = get_task("question")
    ex = task.examples("eval", 1, seed=0, difficulty=1)[0]
    a, b = ex.fields["a"], ex.fields["b"]
    assert ex.prompt.startswith("What is") and ex.prompt.endswith("Answer with the number only.")
    assert ex.answer == str(a + b)
    assert task.verify(f" {a + b}\nmore", ex) == 1.0
    assert task.verify(f"{a} + {b} = {a + b}", ex) == 0.5  # WORDY_CREDIT
    assert task.verify(f"The answer is {a + b}.", ex) == 0.5
    assert task.verify(str(a + b + 1), ex) == FORMAT_CREDIT
    assert task.verify(f"The answer is {a + b + 1}.", ex) == 0.0
    assert len({e.prompt for e in task.examples("train", 150, difficulty=1)}) == 150


def test_a_chat_sum_is_right_when_the_replys_last_number_is_the_sum():
    task = get_task("chat_sum")
    ex = task.examples("eval", 1, seed=0)[0]
    a, b = ex.fields["a"], ex.fields["b"]
    assert min(a, b) >= 10 and max(a, b) <= 99
    assert ex.prompt.startswith("What is") and ex.answer == str(a + b)
    for right in (f"{a + b}", f"{a} + {b} = {a + b}\nmore 5", f"The sum of {a} and {b} is {a + b}."):
        assert task.verify(right, ex) == 1.0, right
    assert task.verify(f"{a} + {b} = {a + b + 1}", ex) == FORMAT_CREDIT
    assert task.verify(f"{a + b} is not it: {a}", ex) == FORMAT_CREDIT  # the last number is the answer
    assert task.verify("To add them, we need to combine", ex) == 0.0
    assert len({e.prompt for e in task.examples("train", 2000)}) == 2000


def test_bad_task_requests_say_what_is_valid():
    valid = "valid: arithmetic, countdown, reverse, sort, repeat, question, chat_sum, shapes"
    with pytest.raises(ConfigError, match=valid):
        get_task("additon")
    with pytest.raises(ConfigError, match=r"has difficulties \[1, 2, 3, 4\], got 9"):
        get_task("arithmetic").examples("train", 5, difficulty=9)
    with pytest.raises(ConfigError, match="only about 9 distinct eval problems"):
        get_task("arithmetic").examples("eval", 50, difficulty=1)
