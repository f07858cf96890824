"""The tool-use demo's parts (``tool_calc``, the tiny chat model, ``recipes/agent-tools.yaml``):
scripted chats encode as the player appends them, a Hermes call parsed from a model turn runs the
task's tool and the answer is scored by the task's verifier, and a short ``tether train`` of the
recipe plays episodes that call the tools."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
END = "<|im_end|>"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tether.data.tiny_model import init_model

    path = tmp_path_factory.mktemp("chat") / "model"
    init_model(path, size="tiny", chat=True)
    return path


@pytest.fixture(scope="module")
def cfg():
    from tests.configs import config

    return config("model.family=agent", "data.task=tool_calc", "data.chat_template=true")


def examples():
    from tether.families.agent.tasks import TOOL_CALC

    return TOOL_CALC.examples("train", 8, difficulty=1) + TOOL_CALC.examples("train", 4, difficulty=2)


def test_chat_tokenizer_keeps_the_protocol_in_single_tokens(chat_model):
    from transformers import AutoTokenizer

    from tether.decoding.stops import turn_ends

    tok = AutoTokenizer.from_pretrained(chat_model)
    for token in ("<|im_start|>", END, "<tool_call>", "</tool_call>"):
        assert len(tok(token, add_special_tokens=False).input_ids) == 1, token
    # the turn ends at the template's <|im_end|>, not only at the tokenizer's EOS (<eos>)
    assert tok.convert_tokens_to_ids(END) in turn_ends(tok, "").end_ids
    # the tool-call tags survive the decoding that drops special tokens (episodes.jsonl's)
    call = tok('<tool_call>{"name": "lookup"}</tool_call>', add_special_tokens=False).input_ids
    assert tok.decode(call, skip_special_tokens=True) == '<tool_call>{"name": "lookup"}</tool_call>'


def test_scripts_encode_as_the_whole_chat_renders(chat_model, cfg):
    """Each scripted chat, encoded turn by turn as the player appends them, is the template's
    rendering of the whole conversation, with labels on exactly the model's turns."""
    from transformers import AutoTokenizer

    from tether.decoding.stops import turn_ends
    from tether.families.agent.sampler import chat_options
    from tether.families.agent.tasks import TOOL_CALC
    from tether.families.agent.warmstart import encode_transcript

    tok = AutoTokenizer.from_pretrained(chat_model)
    options = chat_options(cfg)
    assert [t["function"]["name"] for t in options.tools] == ["calculator", "lookup"]
    rng = random.Random(0)
    tools_seen = set()
    for ex in examples():
        segments = TOOL_CALC.script(ex, rng, 1.0)
        sequences = encode_transcript(tok, segments, chat=True, options=options,
                                      end_ids=turn_ends(tok, "").end_ids)
        assert len(sequences) == 1  # append-only: the player never starts a second sample
        [(ids, labels)] = sequences
        messages = []
        for text, by_model in segments:
            if by_model:
                assert text.endswith(END)
                messages.append({"role": "assistant", "content": text.removesuffix(END)})
            else:
                messages += text
                tools_seen.update(m.get("name") for m in text if m["role"] == "tool")
        whole = options.render(tok, messages, False)
        assert tok.decode(ids, skip_special_tokens=False) == whole.removesuffix("\n")
        model_text = "".join(text for text, by_model in segments if by_model)
        assert tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != -100],
                          skip_special_tokens=False) == model_text
        assert whole.startswith("<|im_start|>system\ncalculator(expression)\nlookup(key)<|im_end|>\n")
    assert tools_seen == {"calculator", "lookup"}


def test_a_parsed_call_runs_the_tool_and_the_answer_is_verified(cfg):
    """The environment the recipe builds (ToolCalc with its default tools, the hermes parser, the
    task's verifier as answer reward) answers each scripted call with the script's tool message,
    and scores the scripted answer 1 and another 0."""
    from tether.families.agent.envthreads import awaited
    from tether.families.agent.sampler import environment_factory, task_row
    from tether.families.agent.tasks import TOOL_CALC

    make = environment_factory(cfg)
    rng = random.Random(1)
    for ex in examples():
        segments = TOOL_CALC.script(ex, rng, 1.0)
        for wrong in (False, True):
            env = make()
            assert env.reset(task_row(ex), 0) == segments[0][0]
            for (action, _), (observation, _) in zip(segments[1:-1:2], segments[2::2], strict=True):
                step = awaited(env.step(action.removesuffix(END)))
                assert step.observation == observation and not step.done
                assert step.info["tool_calls"] == 1 and step.info["tool_errors"] == 0
            answer = segments[-1][0].removesuffix(END)
            step = awaited(env.step(answer + "0" if wrong else answer))
            assert step.done and step.reward == (0.0 if wrong else 1.0)


def test_calculator_evaluates_integer_arithmetic_only():
    from tether.families.agent.tasks import calculator

    assert calculator("7*12+3") == "87" and calculator("(2-9)*3") == "-21"
    for bad in ("__import__('os').getpid()", "2**10", "7/2", "1.5+1", "999999*999999", "x"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_chats_without_the_tools_answer_0_and_are_rarely_right():
    """The warm start's chats that skip the tools (quality 0) answer 0 at once, always: right about
    1 time in 20 at difficulty 1 (a lookup whose value is 0). At quality 0.4 about 4 chats in 10
    call a tool."""
    from tether.families.agent.tasks import TOOL_CALC

    rng = random.Random(2)
    exs = TOOL_CALC.examples("train", 400, difficulty=1)
    scripts = [TOOL_CALC.script(ex, rng, 0.0) for ex in exs]
    assert all(len(s) == 2 and s[1] == ("0" + END, True) for s in scripts)
    right = sum(TOOL_CALC.verify(s[-1][0].removesuffix(END), ex) for s, ex in zip(scripts, exs, strict=True))
    assert 0 < right / len(exs) < 0.1
    calling = sum(len(TOOL_CALC.script(ex, rng, 0.4)) > 2 for ex in exs)
    assert 0.3 < calling / len(exs) < 0.5


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_recipe_trains_episodes_that_call_the_tools(tmp_path):
    """``recipes/agent-tools.yaml`` cut short (a tiny chat model warm-started on chats that all call
    a tool, 3 batches): its episodes call the tools through the parser and get tool messages."""
    model, run = tmp_path / "model", tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "train", "recipes/agent-tools.yaml", "--run-dir", run,
         "--plain", "--no-report", f"model.path={model}", "model.init_size=tiny", "data.num_train=64",
         "data.num_eval=8", "env.script_quality=1.0", "warmstart.max_steps=300", "warmstart.eval_every=300",
         "warmstart.batch_size=8", "train.num_batches=3", "rollout.batch_size=4", "rollout.group_size=4",
         "eval.interval=3", "checkpoint.interval=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=550)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tiny qwen3 chat model" in out.stderr
    from transformers import AutoTokenizer

    from tether.data.tiny_model import CHATML_TEMPLATE

    assert AutoTokenizer.from_pretrained(model).chat_template == CHATML_TEMPLATE
    episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 3 * 4 * 4 and all(e["status"] != "error" for e in episodes)
    assert all(e["transcript"][0].startswith("[user] ") for e in episodes)
    calls = [t for e in episodes for t in e["transcript"][1::2] if t.startswith("<tool_call>{")]
    replies = [t for e in episodes for t in e["transcript"][2::2] if t.startswith("[tool ")]
    assert calls and replies
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["agent/tool_calls"] for m in metrics) > 0
    for key in ("tool_calls", "tool_errors", "malformed_calls"):  # every episode line has every count
        assert sum(e[key] for e in episodes) == sum(m[f"agent/{key}"] for m in metrics), key
