"""Tool calls: the Hermes and JSON parsers, schemas from Python functions, argument checks, and the
tool environment's answers to good, bad and malformed calls."""

import asyncio
from typing import Literal

import pytest

from tether.errors import ConfigError
from tether.families.agent.env import EnvContractError, as_step, observation_of, plain_text, transcript_text
from tether.families.agent.tools import (
    ToolCall,
    ToolEnv,
    check_arguments,
    load_parser,
    parse_hermes,
    parse_json,
    tool_schema,
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number,
            zero when not given.
    """
    return a + b


def pick(kind: Literal["x", "y"], tags: list[str] | None = None, scale: float = 1.0,
         loud: bool = False) -> str:
    """Pick one."""
    return f"{kind}:{tags}:{scale}:{loud}"


async def slow_echo(text: str) -> dict:
    """Echo, after awaiting."""
    await asyncio.sleep(0)
    return {"echo": text}


def broken(text: str) -> str:
    """Always raises."""
    raise ValueError(f"cannot do {text}")


def run(coro):
    return asyncio.run(coro)


def test_hermes_reads_every_call_of_a_turn_and_the_text_around_them():
    turn = parse_hermes('let me see <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
                        '<tool_call>\n{"name": "pick", "arguments": "{\\"kind\\": \\"x\\"}"}\n</tool_call>')
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("pick", {"kind": "x"})]
    assert turn.errors == [] and turn.content == "let me see"


@pytest.mark.parametrize("text, says", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs "name"'),
    ('<tool_call>["add"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object, not list"),
    ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "a string that is not JSON"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "no closing </tool_call>"),
])
def test_hermes_reports_each_malformed_call_without_dropping_the_good_ones(text, says):
    turn = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 5}}</tool_call>' + text)
    assert turn.calls == [ToolCall("add", {"a": 5})]
    assert len(turn.errors) == 1 and says in turn.errors[0], turn.errors


def test_hermes_reads_the_call_after_one_left_open():
    turn = parse_hermes('<tool_call>{"name": "a", "arguments": {}}'
                        '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c.name for c in turn.calls] == ["b"]
    assert turn.errors == ['the tool call \'{"name": "a", "arguments": {}}\' has no closing </tool_call>']


def test_a_turn_without_calls_is_its_answer():
    assert parse_hermes(" 42 ") == parse_json("42") == parse_hermes("42")
    assert parse_hermes("42").content == "42" and parse_hermes("42").calls == []


def test_json_reads_one_call_a_list_a_fence_and_llama_parameters():
    assert parse_json('{"name": "add", "arguments": {"a": 1}}').calls == [ToolCall("add", {"a": 1})]
    assert parse_json('```json\n[{"name": "add", "parameters": {"a": 2}}, {"name": "pick"}]\n```').calls == [
        ToolCall("add", {"a": 2}), ToolCall("pick", {})]
    assert "not valid JSON" in parse_json('{"name": "add"').errors[0]


def test_parser_key_names_a_builtin_or_a_function_and_refuses_anything_else(tmp_path):
    assert load_parser("hermes") is parse_hermes
    own = tmp_path / "p.py"
    own.write_text("from tether.families.agent.tools import ParsedTurn\ndef mine(text):\n"
                   "    return ParsedTurn(text)\n")
    assert load_parser(f"{own}:mine")("hi").content == "hi"
    with pytest.raises(ConfigError, match=r"env\.tool_parser='xml'"):
        load_parser("xml")


def test_schema_from_hints_and_a_google_docstring():
    schema = tool_schema(add)["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    params = schema["parameters"]
    assert params["required"] == ["a"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert params["properties"]["b"]["description"] == "The second number, zero when not given."
    props = tool_schema(pick)["function"]["parameters"]["properties"]
    assert props["kind"] == {"enum": ["x", "y"]}
    assert props["tags"] == {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
    assert props["scale"] == {"type": "number"} and props["loud"] == {"type": "boolean"}


def test_a_function_a_schema_cannot_state_is_refused_naming_it():
    def varargs(*xs: int) -> int:
        return 0

    def odd(x: complex) -> int:
        return 0

    with pytest.raises(ConfigError, match="varargs takes \\*xs"):
        tool_schema(varargs)
    with pytest.raises(ConfigError, match=r"env\.tools: argument 'x' of odd"):
        tool_schema(odd)


@pytest.mark.parametrize("args, says", [
    ({"a": 1, "c": 2}, "add has no argument 'c'; it takes a (integer), b (integer)"),
    ({"b": 2}, "add needs 'a'"),
    ({"a": "1"}, 'a must be integer, not "1"'),
    ({"a": True}, "a must be integer, not true"),
    ({"a": 1.5}, "a must be integer, not 1.5"),
])
def test_arguments_that_do_not_fit_the_schema_are_named(args, says):
    assert says in check_arguments(tool_schema(add), args)


def test_arguments_that_fit_pass():
    assert check_arguments(tool_schema(add), {"a": 1}) == ""
    assert check_arguments(tool_schema(pick), {"kind": "y", "tags": None, "scale": 2}) == ""
    assert "kind must be one of" in check_arguments(tool_schema(pick), {"kind": "z"})


def make_env(**kw):
    env = ToolEnv([add, pick, slow_echo, broken],
                  answer_reward=lambda answer, task: float(answer == task["answer"]), **kw)
    first = env.reset({"prompt": "what is 1+2?", "answer": "3"}, 0)
    assert first == [{"role": "user", "content": "what is 1+2?"}]
    return env


def test_tool_env_answers_every_call_in_order_with_tool_messages():
    env = make_env()
    step = as_step(run(env.step(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "slow_echo", "arguments": {"text": "hi"}}</tool_call>')))
    assert step.observation == [{"role": "tool", "name": "add", "content": "3"},
                                {"role": "tool", "name": "slow_echo", "content": '{"echo": "hi"}'}]
    assert not step.done and step.reward == 0.0
    assert step.info == {"tool_calls": 2, "tool_errors": 0, "malformed_calls": 0}


def test_tool_env_scores_a_turn_without_calls_as_the_answer():
    env = make_env()
    right, wrong = run(env.step(" 3 ")), run(make_env().step("4"))
    assert right.done and right.reward == 1.0 and wrong.reward == 0.0


def test_bad_calls_are_data_for_the_model_counted_and_optionally_penalised():
    env = make_env(malformed_reward=-0.5, max_calls=4)
    step = run(env.step(
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>'
        '<tool_call>{"name": "broken", "arguments": {"text": "it"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
        '<tool_call>{name: add}</tool_call>'))
    contents = [m["content"] for m in step.observation]
    assert contents[0] == "error: there is no tool 'nope'; the tools are add, pick, slow_echo, broken"
    assert contents[1] == 'error: add: a must be integer, not "x"'
    assert contents[2] == "error: broken raised ValueError: cannot do it"
    assert contents[3] == "2"
    assert contents[4] == "error: not run; at most 4 tool calls a turn"
    assert contents[5].startswith("error: the tool call '{name: add}' is not valid JSON")
    assert step.info == {"tool_calls": 5, "tool_errors": 4, "malformed_calls": 1}
    assert step.reward == -0.5 and not step.done


def test_a_tool_that_calls_exit_is_a_tool_error_not_the_end_of_the_episode():
    import sys

    def quits(code: int) -> str:
        """Exits."""
        sys.exit(code)

    env = ToolEnv([add, quits], answer_reward=lambda answer, task: 0.0)
    env.reset({"prompt": "p", "answer": "3"}, 0)
    step = as_step(run(env.step('<tool_call>{"name": "quits", "arguments": {"code": 3}}</tool_call>'
                                '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')))
    assert [m["content"] for m in step.observation] == ["error: quits called exit(3)", "1"]
    assert step.info == {"tool_calls": 2, "tool_errors": 1, "malformed_calls": 0} and not step.done


def test_observations_may_be_messages_checked_as_they_arrive():
    one = {"role": "tool", "name": "add", "content": "3"}
    assert observation_of(one, "step") == [one]
    assert plain_text([one, {"role": "user", "content": "go"}]) == "3go"
    assert transcript_text([one, {"role": "user", "content": "go"}]) == "[tool add] 3\n[user] go"
    for bad, says in [({"role": "assistant", "content": "x"}, "'role' \\(user, tool, system\\)"),
                      ({"role": "user"}, "'content' \\(str\\)"),
                      ([{"role": "user", "content": "x", "id": 3}], "'id' is not"),
                      (3, "expected text \\(str\\) or chat messages")]:
        with pytest.raises(EnvContractError, match=says):
            observation_of(bad, "step")
