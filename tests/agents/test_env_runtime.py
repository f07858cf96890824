"""The environment runtime on a real tiny model: each episode's calls on one thread and one event
loop for its whole life, deadlines from when a call starts, env.workers a hard bound, the
configuration that reaches an environment, and budgets checked against the model's context when
the run starts."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

from tether.config.config import load_config
from tether.errors import ConfigError
from tether.vocabulary import Example, SamplingParams, WorkItem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ENVS = Path(__file__).with_name("runtime_envs.py")


def envs_module():
    """runtime_envs.py as ``env.env_class`` loads it (its module state is what the environments see)."""
    from tether.pyload import load_python_object

    return sys.modules[load_python_object(f"{ENVS}:SlowReset", what="env.env_class").__module__]


def config(model_dir, env: str, *extra: str):
    return load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={model_dir}",
                              f"env.env_class={ENVS}:{env}", "env.max_turns=4", "env.max_turn_tokens=5",
                              "rollout.max_new_tokens=5", "env.step_timeout_s=5", "rollout.group_size=4",
                              *extra])


def play(cfg, n_tasks: int, group_size: int = 4):
    from tether.families.agent.sampler import AgentSampler

    sampler = AgentSampler(cfg, str(cfg.model.path), cfg.env.turn_stop, device=torch.device("cpu"), threads=1,
                           seed=0)
    examples = [(i, Example(prompt=f"task {i}", answer=str(i))) for i in range(n_tasks)]
    try:
        return sampler.generate(WorkItem(batch_index=0, version=0, examples=examples, group_size=group_size,
                                         params=SamplingParams(max_new_tokens=5, temperature=1.0), seed=11))
    finally:
        sampler.close()


@pytest.mark.parametrize("workers", [3, 0])
def test_an_async_environment_keeps_its_loop_its_tasks_and_its_locks_from_reset_to_close(
        tiny_model_dir, workers):
    module = envs_module()
    module.CLOSED.clear()
    batch = play(config(tiny_model_dir, "AsyncClient", f"env.workers={workers}"), 4)
    assert batch.statuses == ["done"] * 16, batch.errors
    assert batch.turns == [2] * 16 and batch.rewards == [2.0] * 16
    assert module.CLOSED == ["same"] * 16  # close too ran on reset's thread and loop


def test_a_sync_environment_keeps_its_thread_so_a_sqlite_connection_serves_every_step(tiny_model_dir):
    module = envs_module()
    module.CLOSED.clear()
    batch = play(config(tiny_model_dir, "SqliteTable", "env.workers=8"), 4)
    assert batch.statuses == ["done"] * 16, batch.errors
    assert batch.turns == [2] * 16
    assert module.CLOSED == ["sqlite"] * 16


def test_a_call_waiting_for_a_worker_is_not_timed_out_for_waiting(tiny_model_dir):
    """Eight 0.3 s resets on two workers take 1.2 s in all; each call takes 0.3 s of its 0.8 s."""
    module = envs_module()
    module.PEAK = 0
    batch = play(config(tiny_model_dir, "SlowReset", "env.workers=2", "env.step_timeout_s=0.8"), 2)
    assert batch.statuses == ["done"] * 8, batch.errors
    assert batch.metrics["agent/timeouts"] == 0
    assert module.PEAK == 2


def test_workers_bound_the_calls_at_once_also_while_timed_out_calls_still_run(tiny_model_dir):
    """Two episodes' steps hang past their timeout on three workers: they end as timeouts, the
    others go on with the one worker left, and never more than three calls run at once."""
    module = envs_module()
    module.PEAK = 0
    batch = play(config(tiny_model_dir, "SomeHang", "env.workers=3", "env.step_timeout_s=0.6",
                        "env.max_failed_frac=1"), 8, group_size=1)
    assert batch.statuses == ["timeout", "done", "done", "done"] * 2, batch.errors
    assert batch.metrics["agent/abandoned_calls"] == 2
    assert module.PEAK == 3


def test_when_every_worker_is_held_by_a_hung_call_the_waiting_episodes_time_out_not_hang(tiny_model_dir):
    module = envs_module()
    batch = play(config(tiny_model_dir, "SomeHang", "env.workers=2", "env.step_timeout_s=0.5",
                        "env.max_failed_frac=1"), 8, group_size=1)
    assert batch.statuses[0] == batch.statuses[4] == "timeout"
    stuck = [e for e in batch.errors if "found every one of the env.workers=2 slots held" in e]
    assert stuck and module.PEAK <= 3


def test_env_kwargs_are_the_constructors_keyword_arguments(tiny_model_dir):
    batch = play(config(tiny_model_dir, "Tabled", "env.kwargs={table: prices, difficulty: 3}"), 1)
    assert batch.statuses == ["done"] * 4 and batch.rewards == [3.0] * 4
    assert batch.transcripts[0][0] == "prices at 3\n"


def test_a_skyrl_gym_environment_gets_env_config_by_attribute_and_max_turns_in_its_extras(tiny_model_dir):
    batch = play(config(tiny_model_dir, "FakeSearch", "env.max_turns=3",
                        "env.env_config={search_url: 'http://127.0.0.1:9/retrieve', topk: 2}"), 1)
    assert batch.statuses == ["done"] * 4, batch.errors
    assert batch.turns == [3] * 4  # extras['max_turns'] = env.max_turns, not the class's default of 2
    assert batch.transcripts[0][2] == "asked http://127.0.0.1:9/retrieve for 2\n"


@pytest.mark.parametrize(("env", "extra", "says"), [
    ("Tabled", "env.kwargs={tabel: prices}", r"environment Tabled cannot be built: .*Tabled\(\).*"),
    ("FakeSearch", "env.kwargs={topk: 2}",
     r"env.kwargs=\{'topk': 2\} is for environments built with keyword arguments; FakeSearch is a skyrl-gym "
     r"environment.*env.env_config"),
    ("Tabled", "env.env_config={table: prices}", r"env.env_config is skyrl-gym's env_config; Tabled is not a "
                                                  r"skyrl-gym environment .*env.kwargs"),
])
def test_configuration_an_environment_cannot_take_is_refused_when_the_recipe_loads(
        tiny_model_dir, env, extra, says):
    with pytest.raises(ConfigError, match=says):
        config(tiny_model_dir, env, extra)


def _context(model_dir) -> int:
    from tether.modeling import context_length, model_config

    return context_length(model_config(model_dir))


@pytest.mark.parametrize(("keys", "says"), [
    (["env.max_episode_tokens={n1}"],
     r"env.max_episode_tokens={n1} is more than the model's context of {n} "),
    (["env.max_turn_tokens={n}", "env.max_episode_tokens=0"],
     r"env.max_turn_tokens={n} leaves no room for an observation in the model's context of {n} "),
])
def test_budgets_past_the_models_context_are_refused_when_the_run_starts(tiny_model_dir, keys, says):
    n = _context(tiny_model_dir)
    cfg = config(tiny_model_dir, "Tabled", "env.kwargs={table: t}", *(k.format(n=n, n1=n + 1) for k in keys))
    with pytest.raises(ConfigError, match=says.format(n=n, n1=n + 1)):
        cfg.family().data(cfg, Path(tiny_model_dir))
    within = config(tiny_model_dir, "Tabled", "env.kwargs={table: t}", f"env.max_episode_tokens={n}")
    assert within.family().data(within, Path(tiny_model_dir)).train


def test_skyrl_gyms_own_search_env_is_built_from_env_config_and_max_turns():
    """skyrl-gym's SearchEnv as the adapter builds it: its tool's URL from env_config, its turn
    limit from extras['max_turns'] (no request is made: the answer ends the episode)."""
    pytest.importorskip("skyrl_gym")
    from skyrl_gym.envs.search.env import SearchEnv

    from tether.families.agent.env import as_step, factory

    settings = {"search_url": "http://127.0.0.1:9/retrieve", "topk": 2, "timeout": 1, "log_requests": False}
    env = factory(SearchEnv, {}, env_config=settings, extras={"max_turns": 3})()
    row = {"prompt": "Who?", "answer": "Ada",  # a SkyRL search row carries its own reward_spec
           "reward_spec": {"method": "rule", "ground_truth": {"target": ["Ada"]}}}
    assert env.reset(row, 0) == "Who?"
    assert env.env.max_turns == 3
    assert (env.env.tool_group.search_url, env.env.tool_group.topk) == ("http://127.0.0.1:9/retrieve", 2)
    step = as_step(env.step("<answer>Ada</answer>"))
    assert step.done and step.reward == 1.0
    env.close()


def test_skyrl_gyms_own_sql_env_reads_its_database_from_env_config_and_the_row(tmp_path):
    """skyrl-gym's SQLEnv as the adapter builds it: the database directory from env_config, the
    database and gold query from the task row (its extras), the turn limit from max_turns; a query
    runs against the database and the solution is scored by its result."""
    pytest.importorskip("skyrl_gym")
    import sqlite3

    from skyrl_gym.envs.sql.env import SQLEnv

    from tether.families.agent.env import as_step, factory, plain_text

    db = tmp_path / "spider" / "database" / "shop" / "shop.sqlite"
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.executescript("CREATE TABLE items (name TEXT, price INT); "
                           "INSERT INTO items VALUES ('pen', 3), ('ink', 5);")
    conn.close()
    env = factory(SQLEnv, {}, env_config={"db_path": str(tmp_path)}, extras={"max_turns": 4})()
    row = {"prompt": "Cheapest item?", "answer": "SELECT name FROM items ORDER BY price LIMIT 1",
           "db_id": "shop", "data": "spider"}
    assert env.reset(row, 0) == "Cheapest item?"
    assert env.env.max_turns == 4 and env.env.db_file == str(db)
    step = as_step(env.step("<sql>SELECT name, price FROM items</sql>"))
    assert not step.done and "pen" in plain_text(step.observation)
    step = as_step(env.step("<think>pen costs 3</think><solution>SELECT 'pen'</solution>"))
    assert step.done and step.reward == 1.0
    env.close()


def test_without_omegaconf_env_config_reads_its_keys_as_attributes():
    from tether.families.agent.env import Attributes

    config = Attributes({"search_url": "u", "retry": {"times": 2}})
    assert (config.search_url, config.retry.times, config.get("topk", 3)) == ("u", 2, 3)
    with pytest.raises(AttributeError, match=r"env\.env_config has no key 'topk'"):
        _ = config.topk
