"""The tool environment played by the episode player through a chat template: role-tagged
observations become turns of their roles, a system prompt and the tool schemas reach the template,
each parsed call is answered, bad calls are data (counted), a hung tool times its episode out, and
recipes naming tools are checked when they load."""

import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tether.config.config import load_config
from tether.errors import ConfigError
from tether.families.agent.chat import ChatOptions
from tether.families.agent.env import factory
from tether.families.agent.envthreads import EnvThreads
from tether.families.agent.episode import Limits
from tether.families.agent.episodes import Player
from tether.families.agent.tools import ToolEnv, tool_schema
from tether.modeling import load_causal_lm
from tether.vocabulary import Completion, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
TOOLS = Path(__file__).with_name("tool_functions.py")
# ChatML with the tools listed in the system turn (one line each) and tool turns of their own
TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.properties | join(',') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, tmp_path_factory):
    model, tokenizer = load_causal_lm(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["{", "}", ";"])  # JSON's braces and the error messages' ;, not in the alphabet
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = TEMPLATE
    model.resize_token_embeddings(len(tokenizer))
    path = tmp_path_factory.mktemp("chat") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Scripted:
    """An engine that samples the given turns, in order, for each episode (its rows in the order the
    player gives them); records the prompts it was given."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.prompts = tokenizer, turns, []

    def generate(self, prompts, *, samples_per_prompt, params, seed):
        out = []
        for ids in prompts:
            self.prompts.append(list(ids))
            text = self.turns[min(sum(p == ids[:len(p)] for p in self.prompts[:-1]), len(self.turns) - 1)]
            token_ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
            out.append([Completion(token_ids, [-0.5] * len(token_ids), [0] * len(token_ids), "stop")])
        return out

    def take_up(self):
        return None


LIMITS = Limits(4, 400, 2000, 5, 60)


def play(path, turns, *, tools, options=None, chat=True, limits=LIMITS, episodes=1):
    _, tokenizer = load_causal_lm(path)
    engine = Scripted(tokenizer, turns)
    env = factory(ToolEnv, {"tools": tools,
                            "answer_reward": lambda answer, task: float(answer == task["answer"])})
    threads = EnvThreads(2)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    player = Player(engine, tokenizer, env, limits, threads, chat=chat, end_ids=[end], chat_options=options)
    try:
        rows = [({"prompt": "what is 2+3?", "answer": "5"}, i) for i in range(episodes)]
        return tokenizer, engine, player.play(rows, SamplingParams(max_new_tokens=400), seed=0)
    finally:
        threads.close()


def test_a_tool_episode_is_the_template_rendering_of_its_conversation(chat_model):
    from tool_functions import add, lookup

    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'
    schemas = [tool_schema(add), tool_schema(lookup)]
    options = ChatOptions(system="be brief", tools=schemas)
    tokenizer, engine, (ep,) = play(chat_model, [call, "5<|im_end|>"], tools=[add, lookup], options=options)
    assert ep.status == "done" and ep.reward(0.0) == 1.0 and ep.turns == 2
    assert ep.counts == {"tool_calls": 1, "tool_errors": 0, "malformed_calls": 0}
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+3?"},
                    {"role": "assistant", "content": call.removesuffix("<|im_end|>")},
                    {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "5"}]
    rendered = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    assert tokenizer.decode(ep.ids, skip_special_tokens=False) == rendered.removesuffix("\n")
    assert rendered.startswith("<|im_start|>system\ntools: add(a,b) lookup(key)<|im_end|>\n"
                               "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is 2+3?")
    # the second turn was generated from exactly the ids the episode holds before it
    second = engine.prompts[1]
    assert second == ep.ids[:len(second)] and tokenizer.decode(second[-20:]).endswith("assistant\n")
    assert ep.transcript == ["[user] what is 2+3?", call.removesuffix("<|im_end|>"), "[tool add] 5", "5", ""]
    model_text = tokenizer.decode([t for t, m in zip(ep.ids, ep.model, strict=True) if m],
                                  skip_special_tokens=False)
    assert model_text == call + "5<|im_end|>"  # the tool message and the template's framing carry no loss


def test_bad_calls_reach_the_model_as_tool_messages_and_are_counted(chat_model):
    from tool_functions import add, lookup

    turns = ['<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>oops</tool_call><|im_end|>',
             '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call><|im_end|>', "5<|im_end|>"]
    tokenizer, _, (ep,) = play(chat_model, turns, tools=[add, lookup],
                               options=ChatOptions(tools=[tool_schema(add), tool_schema(lookup)]))
    assert ep.status == "done" and ep.reward(0.0) == 1.0
    assert ep.counts == {"tool_calls": 2, "tool_errors": 2, "malformed_calls": 1}
    text = tokenizer.decode(ep.ids, skip_special_tokens=False)
    assert "<|im_start|>tool\nerror: there is no tool 'mul'; the tools are add, lookup<|im_end|>" in text
    assert "<|im_start|>tool\nerror: the tool call 'oops' is not valid JSON" in text
    assert "<|im_start|>tool\nerror: lookup raised KeyError: 'x'<|im_end|>" in text


def test_without_a_template_tool_messages_are_appended_as_their_text(chat_model):
    from tool_functions import add

    _, _, (ep,) = play(chat_model, ['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n', "5\n"],
                       tools=[add], chat=False)
    assert ep.status == "done" and ep.transcript[2] == "[tool add] 1"


def test_a_hung_tool_times_its_episode_out_and_nothing_else(chat_model):
    from tool_functions import add, hang

    t0 = time.monotonic()
    hung = '<tool_call>{"name": "hang", "arguments": {"s": 30}}</tool_call><|im_end|>'
    _, _, episodes = play(chat_model, [hung], tools=[add, hang], limits=Limits(4, 400, 2000, 0.5, 60),
                          episodes=2)
    assert [ep.status for ep in episodes] == ["timeout", "timeout"]
    assert time.monotonic() - t0 < 20  # abandoned at its deadline, not waited for


def config(*extra):
    return load_config(None, ["model.family=agent", "data.task=kv_lookup", *extra])


def test_recipes_naming_tools_build_the_tool_environment_with_their_schemas():
    from tether.families.agent.sampler import chat_options, environment_factory

    cfg = config(f"env.tools=[{TOOLS}:add,{TOOLS}:TABLE_TOOLS]", "data.chat_template=true",
                 "data.system_prompt=be brief", "data.chat_template_kwargs={enable_thinking: false}",
                 "env.malformed_call_reward=-0.1", "env.answer_reward=exact_match")
    made = environment_factory(cfg)
    assert made.env_class is ToolEnv
    env = made()
    assert sorted(env.env.tools) == ["add", "lookup"] and env.env.malformed_reward == -0.1
    assert env.env.answer_reward("5", {"prompt": "p", "answer": "5"}) == 1.0
    options = chat_options(cfg)
    assert options.system == "be brief" and options.kwargs == {"enable_thinking": False}
    assert [t["function"]["name"] for t in options.tools] == ["add", "lookup"]


@pytest.mark.parametrize("extra, says", [
    (["env.env_class=tests/agents/envs.py:Echo", f"env.tools=[{TOOLS}:add]"], "is not a tool environment"),
    ([f"env.tools=[{TOOLS}:add,{TOOLS}:add]"], "names add more than once"),
    ([f"env.tools=[{TOOLS}:NOT_A_TOOL]"], "which is not a function"),
    ([f"env.tools=[{TOOLS}:untyped_varargs]"], "untyped_varargs takes \\*args"),
    ([f"env.tools=[{TOOLS}:add]", "env.tool_parser=xml"], "env.tool_parser='xml'"),
    ([f"env.tools=[{TOOLS}:add]", "env.answer_reward=nope"],
     "env.answer_reward='nope': unknown reward 'nope'"),
    (["env.env_class=tests/agents/envs.py:Echo", "env.tool_parser=json"], "env.tool_parser=json configure"),
    (["env.max_tool_calls=3", "env.malformed_call_reward=-1"], "reward=-1.0, env.max_tool_calls=3 configure"),
    (["data.system_prompt=hi"], "data.system_prompt is given to the chat template"),
    (["data.chat_template_kwargs={enable_thinking: false}"], "data.chat_template_kwargs is given"),
])
def test_tool_recipe_mistakes_are_refused_when_the_recipe_loads(extra, says):
    with pytest.raises(ConfigError, match=says):
        config(*extra)


def test_text_prompts_get_the_system_prompt_and_template_arguments_too(chat_model):
    from tether.data.datasets import apply_chat_template
    from tether.vocabulary import Example

    _, tokenizer = load_causal_lm(chat_model)
    tokenizer.chat_template = TEMPLATE + "{% if think %}<think>{% endif %}"
    (ex,) = apply_chat_template(tokenizer, [Example("2+3?", "5")], system="be brief", kwargs={"think": True})
    assert ex.prompt == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
                         "<|im_start|>assistant\n<think>")
