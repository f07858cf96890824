"""The agent family's episodes on vLLM: each turn a token-id prompt of the episode so far, the
engine's log-probs equal to the learner's on model tokens, and nothing on observation tokens."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from episodes import later_turns, scored  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.control.inflight import KEEP  # noqa: E402
from tether.families.agent.policy import AgentPolicy  # noqa: E402
from tether.families.agent.sampler import AgentSampler  # noqa: E402
from tether.vocabulary import SamplingParams, WorkItem  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ECHO = f"{Path(__file__).resolve().parents[1] / 'agents' / 'envs.py'}:Echo"


def test_vllm_plays_multi_turn_episodes_the_learner_scores_alike(demo_model):
    from tether.data.tasks import get_task

    cfg = load_config(
        None,
        [
            "model.family=agent",
            "data.task=kv_lookup",
            f"model.path={demo_model}",
            "rollout.engine=vllm",
            "env.max_turns=3",
            "env.max_turn_tokens=6",
            "rollout.max_new_tokens=6",
            "rollout.group_size=4",
        ],
    )
    sampler = AgentSampler(cfg, str(demo_model), "\n", device=torch.device("cpu"), threads=1, seed=0)
    examples = list(enumerate(get_task("kv_lookup").examples("train", 2, seed=0)))
    try:
        batch = sampler.generate(
            WorkItem(
                batch_index=0,
                version=0,
                examples=examples,
                group_size=4,
                params=SamplingParams(max_new_tokens=6, temperature=1.0),
                seed=3,
            )
        )
    finally:
        sampler.close()
        sampler.engine.close()
    batch.check()
    assert max(batch.turns) >= 1 and batch.metrics["agent/env_tokens_mean"] > 0
    policy = AgentPolicy(1.0)
    train, logp = scored(policy, policy.load(demo_model)[0], batch)
    on = train.mask.bool()
    assert int(on.sum()) == sum(sum(m) for m in batch.model)
    assert (logp[on] - train.behavior_logp[on]).abs().mean() <= 1e-5


def test_on_vllm_a_publication_mid_episode_is_stamped_and_later_turns_start_on_it(demo_model):
    """keep on vLLM: weights published between the first turn and the second; the first turn stays
    on version 0, the turns after it are prefilled and sampled on version 1 alone (a turn boundary
    is a safe point), and the learner at that version scores them as vLLM did."""
    from tether.data.tasks import get_task
    from tether.modeling import unique_parameters

    cfg = load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={demo_model}",
                             "rollout.engine=vllm", "async.inflight_update=keep", "env.max_turns=3",
                             "env.max_turn_tokens=6", "rollout.max_new_tokens=6", "rollout.group_size=4",
                             f"env.env_class={ECHO}"])
    sampler = AgentSampler(cfg, str(demo_model), "\n", device=torch.device("cpu"), threads=1, seed=0)
    engine = sampler.engine
    policy = AgentPolicy(1.0)
    model, _ = policy.load(demo_model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    weights = {name: t.detach().clone() for name, t in unique_parameters(model).items()}
    turns = {"n": 0}
    generate = engine.generate

    def counting(*args, **kw):
        out = generate(*args, **kw)
        turns["n"] += 1  # turns done
        return out

    def poll():  # the publication lands once the first turn is done, before the second starts
        if turns["n"] == 1 and engine.version == 0:
            engine.bind(weights, 1)
            return 1
        return None

    engine.generate = counting
    engine.watch(poll, KEEP)
    examples = list(enumerate(get_task("kv_lookup").examples("train", 1, seed=0)))
    try:
        batch = sampler.generate(WorkItem(batch_index=0, version=0, examples=examples, group_size=4,
                                          params=SamplingParams(max_new_tokens=6, temperature=1.0), seed=3))
    finally:
        sampler.close()
        engine.close()
    assert batch.metrics["rollout/turn_boundary_switches"] == 1
    assert sorted(batch.version_shares()) == [0, 1]
    learner, engine_logp, versions = later_turns(policy, model, batch)
    assert (versions == 1).all()
    assert (learner - engine_logp).abs().mean() <= 1e-5


def test_agent_episodes_train_on_vllm_in_worker_processes_within_the_budget(demo_model, tmp_path):
    """`tether train` with rollout.engine=vllm and in-flight keep: episodes from vLLM in a rollout
    worker process, trained under the budget."""
    import json
    import subprocess
    import sys

    def tether(*args):
        out = subprocess.run([sys.executable, "-m", "tether.cli.main", *map(str, args)], capture_output=True,
                             text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0, out.stderr[-3000:]

    common = ["model.family=agent", "data.task=kv_lookup", "data.num_train=300", "data.num_eval=16",
              "env.max_turns=3", "env.max_turn_tokens=6"]
    model = tmp_path / "model"  # one that sometimes answers right, so the groups' rewards vary
    tether("warmstart", *common, "env.script_quality=0.5", "warmstart.max_steps=40",
           "warmstart.eval_every=40", "warmstart.batch_size=16", "warmstart.target_pass_rate=1",
           "--model", demo_model, "--out", model)
    run = tmp_path / "run"
    tether("train", *common, f"model.path={model}", "rollout.engine=vllm", "async.inflight_update=keep",
           "rollout.batch_size=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.num_batches=4",
           "eval.interval=0", "checkpoint.interval=0", "--run-dir", run, "--plain", "--no-report")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert all(r["staleness/updates"] <= 1 and r["agent/env_tokens_mean"] > 0 for r in rows)
    assert any(r["loss/policy"] is not None for r in rows)


def test_on_vllm_a_drain_at_turn_boundaries_waits_for_the_turns_in_flight(demo_model, tmp_path):
    """`tether train` with vLLM in a worker process, async.inflight_update=drain and
    env.switch_at=turn, against a tool that takes 0.3 s a step: publications land between turns
    (never inside one) after waiting for the turns in flight, and every batch keeps the budget."""
    import json
    import subprocess
    import sys

    envs = Path(__file__).resolve().parents[1] / "agents" / "envs.py"
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "train", "model.family=agent", "data.task=kv_lookup",
         f"model.path={demo_model}", f"env.env_class={envs}:SlowEcho", "env.max_turns=3",
         "env.max_turn_tokens=6", "rollout.engine=vllm", "async.inflight_update=drain", "env.switch_at=turn",
         "rollout.batch_size=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.num_batches=4",
         "eval.interval=0", "checkpoint.interval=0", "--run-dir", str(run), "--plain", "--no-report"],
        capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["staleness/updates"] <= 1 for r in rows)
    assert all(r["rollout/weight_switches"] == r["rollout/turn_boundary_switches"] for r in rows)
    assert sum(r["rollout/turn_boundary_switches"] for r in rows) > 0
    waits = [r["sync/turn_wait_s"] for r in rows if "sync/turn_wait_s" in r]
    assert waits and max(waits) < 0.9  # never a whole episode's three 0.3 s steps


def test_vllm_and_the_built_in_engine_end_the_same_turns_at_the_same_token(demo_model, tmp_path):
    """env.turn_stop of three tokens and an end id only the generation config names: greedy turns on
    vLLM and on the built-in engine are the same ids, each ending at the first token that ends it
    (the ids of ``tether.decoding.stops``, given to both)."""
    import json
    import shutil

    from tether.modeling import load_causal_lm
    from tether.rollout.engines.torch.engine import TorchEngine

    path = tmp_path / "model"
    shutil.copytree(demo_model, path)
    model, tok = load_causal_lm(path)
    prompts = [tok(p, add_special_tokens=False).input_ids
               for p in ("key b\n", "go 23\n", "guess 0-9\n", "x=1\n")]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    free = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    rows = [c.token_ids for (c,) in free.generate(prompts, samples_per_prompt=1, params=greedy, seed=0)]
    # a random model's greedy turns repeat themselves: the stop string is three plain characters one
    # row samples, the end id a character another row samples and that one does not before it
    stop, r = next((tok.decode(row[j:j + 3]), r) for r, row in enumerate(rows) for j in range(1, len(row) - 2)
                   if len(tok.decode(row[j:j + 3])) == 3 and tok.decode(row[j:j + 3]).isalnum())
    before = rows[r][:next(k for k in range(len(rows[r])) if stop in tok.decode(rows[r][:k + 1])) + 1]
    end_id = next(t for q, row in enumerate(rows) if q != r for t in row[1:]
                  if t not in before and len(tok.decode([t])) == 1)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, end_id]}))

    def first_end(row):  # (the turn, how it ended)
        for k in range(len(row)):
            if row[k] in (tok.eos_token_id, end_id) or stop in tok.decode(row[:k + 1]):
                return row[:k + 1], "stop"
        return row, "length"

    expected = [first_end(row) for row in rows]
    assert any(tok.decode(row).endswith(stop) for row, _ in expected)
    assert any(row[-1] == end_id for row, _ in expected)
    got = {}
    for engine in ("torch", "vllm"):
        cfg = load_config(None, ["model.family=agent", "data.task=kv_lookup", f"model.path={path}",
                                 f"rollout.engine={engine}", f"env.turn_stop={stop}",  # letters and digits
                                 "rollout.max_new_tokens=16"])
        sampler = AgentSampler(cfg, str(path), stop, device=torch.device("cpu"), threads=1, seed=0)
        try:
            out = sampler.engine.generate(prompts, samples_per_prompt=1, params=greedy, seed=0)
            got[engine] = [(c.token_ids, c.finish_reason) for (c,) in out]
            if engine == "vllm":  # and stepped one scheduler step at a time (in-flight updates)
                sampler.engine.watch(lambda: None, KEEP)
                out = sampler.engine.generate(prompts, samples_per_prompt=1, params=greedy, seed=0)
                got["vllm stepped"] = [(c.token_ids, c.finish_reason) for (c,) in out]
        finally:
            sampler.close()
            if engine == "vllm":
                sampler.engine.close()
    assert got["torch"] == expected
    assert got["vllm"] == expected
    assert got["vllm stepped"] == expected
