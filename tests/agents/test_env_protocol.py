"""The environment protocol: what ``step`` may return, and which adapter a class gets."""

import asyncio

import pytest

from tether.errors import ConfigError
from tether.families.agent.env import EnvContractError, Step, as_step, factory, kind_of


def test_a_step_a_gymnasium_tuple_and_a_skyrl_output_are_the_same_step():
    assert as_step(Step("o", 1.0, True)) == Step("o", 1.0, True)
    assert as_step(("o", 0.5, False, True, {"k": 1})) == Step("o", 0.5, False, True, {"k": 1})
    skyrl = {
        "observations": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
        "reward": 1,
        "done": True,
        "metadata": {},
    }
    assert as_step(skyrl) == Step("ab", 1, True, False, {})
    # a rewritten history, said each way
    rewrite = {"new_context": True}
    assert as_step(Step("c", new_context=True)).new_context
    assert as_step(("c", 0.0, False, False, rewrite)).new_context
    assert as_step({**skyrl, "metadata": rewrite}).new_context
    assert not as_step(("c", 0.0, False, False, {})).new_context


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (3, "step returned int"),
        (("o", 1.0, False), "step returned tuple"),
        (Step(b"bytes"), "observation of type bytes"),  # type: ignore[arg-type]
        (Step("o", "1"), "reward of type str"),  # type: ignore[arg-type]
        (Step("o", True), "reward of type bool"),
        (Step("o", float("nan")), "non-finite reward"),
        (Step("o", new_context="yes"), "new_context='yes'; expected True or False"),  # type: ignore[arg-type]
        (("o", 0.0, False, False, {"new_context": 1}), "new_context=1; expected True or False"),
        (Step("o", 10**400), r"reward of 1000.*\.\.\.; rewards must lie within ±1e\+06"),
        (Step("o", 2e6), r"reward of 2000000.0; rewards must lie within ±1e\+06"),
        (Step("o", float("-inf")), "non-finite reward -inf"),
        (Step("o", info=None), "info of type NoneType; expected a mapping"),  # type: ignore[arg-type]
        (Step("o", done="false"), "done='false'; expected True or False"),  # type: ignore[arg-type]
        (Step("o", truncated=1), "truncated=1; expected True or False"),  # type: ignore[arg-type]
        (("o", 0.0, "yes", False, {}), "done='yes'; expected True or False"),
        ({"observations": [], "reward": 0.0, "done": None}, "done=None; expected True or False"),
    ],
)
def test_a_step_of_the_wrong_shape_is_refused_saying_what_was_wrong(value, says):
    with pytest.raises(EnvContractError, match=says):
        as_step(value)


def test_numpy_rewards_and_flags_are_taken_as_the_python_values_they_hold():
    np = pytest.importorskip("numpy")
    step = as_step(Step("o", np.float32(0.5), np.bool_(True), np.bool_(False), {}, np.bool_(False)))
    assert step == Step("o", 0.5, True, False, {}, False)
    fields = (step.reward, step.done, step.truncated, step.new_context)
    assert [type(v) for v in fields] == [float, bool, bool, bool]
    assert as_step(("o", np.int64(2), np.bool_(False), np.bool_(True), {})) == Step("o", 2.0, False, True, {})
    assert as_step({"observations": [], "reward": np.array(1.0), "done": np.bool_(True)}).reward == 1.0
    with pytest.raises(EnvContractError, match="reward of type bool"):
        as_step(Step("o", np.bool_(True)))


class Native:
    def reset(self, task, seed):
        return f"hi {task['x']} {seed}\n"

    def step(self, action):
        return Step("ok\n", done=True)


class AsyncNative:
    async def reset(self, task, seed):
        await asyncio.sleep(0)
        return "async\n"

    async def step(self, action):
        return ("o", 2.0, True, False, {})

    async def close(self):
        self.closed = True


class Gym:
    def __init__(self):
        self.options = None

    def reset(self, *, seed=None, options=None):
        self.options = options
        return f"gym {options['x']}\n", {}

    def step(self, action):
        return "o", 0.0, False, False, {}


class SkyRL:
    def __init__(self, env_config, extras):
        self.extras = extras

    def init(self, prompt):
        return [{"role": "user", "content": f"sky {self.extras['x']}\n"}], {}

    def step(self, action):
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}


@pytest.mark.parametrize(
    ("cls", "kind", "first"),
    [
        (Native, "native", "hi 7 3\n"),
        (AsyncNative, "native", "async\n"),
        (Gym, "gymnasium", "gym 7\n"),
        (SkyRL, "skyrl", "sky 7\n"),
    ],
)
def test_every_kind_of_environment_is_adapted_to_reset_and_step(cls, kind, first):
    assert kind_of(cls) == kind
    env = factory(cls, {})()
    assert env.reset({"x": 7, "prompt": "p"}, 3) == first
    assert isinstance(as_step(env.step("a")), Step)
    env.close()


def test_a_class_that_is_not_an_environment_is_refused_with_what_it_needs():
    class NoStep:
        def reset(self, task, seed):
            return ""

    with pytest.raises(ConfigError, match=r"needs reset\(task, seed\) and step\(action\)"):
        factory(NoStep, {})


def test_a_real_skyrl_gym_environment_plays_through_the_adapter(tiny_model_dir):
    """skyrl-gym 0.4's own multi-turn GSM8K environment, as SkyRL builds it, played by a real tiny
    model: its rewards and its end, with the row's answer as its ground truth."""
    pytest.importorskip("skyrl_gym")
    pytest.importorskip("torch")
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    from tether.decoding.sampling import stop_ids_for
    from tether.families.agent.envthreads import EnvThreads
    from tether.families.agent.episode import Limits
    from tether.families.agent.episodes import Player
    from tether.modeling import load_causal_lm
    from tether.rollout.engines.torch.engine import TorchEngine
    from tether.vocabulary import SamplingParams

    assert kind_of(GSM8kMultiTurnEnv) == "skyrl"
    model, tokenizer = load_causal_lm(tiny_model_dir)
    engine = TorchEngine(model, pad_id=tokenizer.pad_token_id, stop_ids=stop_ids_for(tokenizer, "\n"))
    threads = EnvThreads(2)
    player = Player(engine, tokenizer, factory(GSM8kMultiTurnEnv, {}),
                    Limits(max_turns=5, max_turn_tokens=4, max_episode_tokens=256, step_timeout_s=10,
                           episode_timeout_s=60), threads)
    try:
        episodes = player.play([({"prompt": "2+2=?\n", "answer": "4", "max_turns": 2}, 0)] * 2,
                               SamplingParams(max_new_tokens=4, temperature=1.0), seed=0)
    finally:
        threads.close()
    for ep in episodes:
        assert ep.status == "done" and ep.turns == 2, (ep.status, ep.error)
        assert ep.transcript[0] == "2+2=?\n"
        assert ep.transcript[2].startswith("Now provide only the final numeric answer")  # SkyRL's own text
        assert len(ep.step_rewards) == 2
