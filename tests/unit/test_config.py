"""Strict typed config: recipes, dotted overrides, and errors that say what to change."""

import pickle
import re
from pathlib import Path

import pytest
import yaml

from tether.config import Config, load_config, reference_markdown
from tether.config.presets import PRESETS, preset
from tether.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_match_the_documented_ones():
    c = Config()
    assert (c.async_.max_staleness, c.async_.max_inflight, c.async_.on_stale) == (1, 2, "error")
    assert c.train.updates_per_batch == 1
    assert (c.eval.interval, c.checkpoint.interval) == (0, 0)


def test_recipe_plus_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("async:\n  max_staleness: 2\ntrain:\n  num_batches: 30\n")
    c = load_config(recipe, ["async.max_staleness=3", "train.updates_per_batch=4",
                             "plan.commits=[4, 2]", "async.on_stale=drop"])
    assert c.async_.max_staleness == 3  # the override wins over the recipe
    assert c.train.num_batches == 30
    assert c.plan.commits == [4, 2]
    b = c.budget()
    assert (b.staleness_budget, b.admission_depth, b.on_stale) == (12, 4, "drop")


def test_int_given_for_a_float_key_is_accepted_and_comma_lists_parse():
    c = load_config(None, ["plan.gen_time=2", "plan.commits=1,2,0", "train.lr=1e-4"])
    assert c.plan.gen_time == 2.0 and isinstance(c.plan.gen_time, float)
    assert c.train.lr == 1e-4  # YAML 1.1 reads 1e-4 as a string; a float key accepts it
    with pytest.raises(ConfigError, match=r"train\.lr must be a number, got 'fast'"):
        load_config(None, ["train.lr=fast"])
    assert c.plan.commits == [1, 2, 0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("async.max_stalness=3", "unknown key 'async.max_stalness'; did you mean async.max_staleness?"),
        ("asynk.max_staleness=3", "unknown section 'asynk'; did you mean 'async'?"),
        ("train.max_staleness=3", "max_staleness belongs in another section: async.max_staleness"),
        ("train.batch_size=3", "belongs in another section: rollout.batch_size or warmstart.batch_size"),
        ("max_inflight.x=3", "unknown section 'max_inflight'; max_inflight is a key: async.max_inflight"),
        ("async.max_staleness=-1", "async.max_staleness must be >= 0, got -1"),
        ("async.max_staleness=two", "async.max_staleness must be an integer, got 'two'"),
        ("async.max_staleness=1.5", "async.max_staleness must be an integer, got 1.5"),
        ("async.max_staleness=true", "must be an integer, got True"),
        ("async.on_stale=dorp", "must be one of 'error', 'drop', got 'dorp' (did you mean 'drop'?)"),
        ("plan.gen_time=-0.5", "plan.gen_time must be >= 0"),
        ("plan.commits=1,x", "plan.commits[1] must be an integer"),
        ("async.zzz=1", "valid keys in 'async' are: inflight_update, max_consecutive_drops"),
        ("max_staleness=3", "must be section.key"),
        ("async", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_bad_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("async: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(listy)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("async: 3\n")
    with pytest.raises(ConfigError, match="async must be a mapping"):
        load_config(wrong)


def test_round_trip_through_yaml(tmp_path):
    c = load_config(None, ["async.max_staleness=4", "plan.commits=[1]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(c.to_yaml())
    assert load_config(path) == c


def test_every_shipped_recipe_loads():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert recipes, "recipes/ is empty"
    for recipe in recipes:
        load_config(recipe)


def test_reference_doc_is_generated_from_the_schema_and_up_to_date():
    committed = (ROOT / "docs" / "reference.md").read_text()
    assert committed.strip() == reference_markdown().strip(), (
        "docs/reference.md is stale: run `make docs` (tether config reference > docs/reference.md)"
    )
    for key in Config().to_dict()["async"]:
        assert f"`async.{key}`" in committed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.dataset=x.jsonl"], "set exactly one of data.task (a built-in task) and data.dataset"),
        (["data.task="], "set exactly one of data.task"),
        (["data.task=", "data.dataset=x.jsonl"], "reward.function=task scores with a built-in task's"),
        (["data.eval_dataset=y.jsonl"], "data.eval_dataset is set but data.dataset is not"),
        (["model.init_size=huge"], "model.init_size must be one of 'tiny', 'small', 'base'"),
        (["warmstart.target_pass_rate=1.5"], "warmstart.target_pass_rate must be <= 1"),
        (["ray.address=auto"], "the ray section is set, but it is read only with rollout.backend=ray "
                               "(rollout.backend is 'local'); set rollout.backend=ray to use it, or remove"),
        (["ray.gpus_per_worker=1"], "the ray section is set, but it is read only with rollout.backend=ray"),
        (["rollout.backend=slurm"], "rollout.backend must be one of 'local', 'ray'"),
        (["vllm.dtype=bfloat16"], "the vllm section is set, but it is read only with rollout.engine=vllm "
                                  "(rollout.engine is 'torch')"),
        (["rollout.engine=sglang"], "rollout.engine must be one of 'torch', 'vllm'"),
        (["rollout.engine=vllm", "rollout.decoder=python"],
         "rollout.decoder=python is read only with rollout.engine=torch (rollout.engine is 'vllm'); remove "
         "rollout.decoder, or set rollout.engine=torch"),
        (["model.family=flow", "data.task=shapes", "rollout.decoder=native"],
         "rollout.decoder=native asks for a choice of token decoder, which model.family=flow does not have "
         "(a flow model's sampler has no native form)"),
        (["model.family=flow", "data.task=arithmetic"],
         "data.task=arithmetic is a task of model.family=text; model.family=flow has: shapes"),
        (["data.task=shapes"], "data.task=shapes is a task of model.family=flow; model.family=text has: "
                               "arithmetic, countdown"),
        (["model.family=flow", "data.task=shapes", "model.init_arch=llama"],
         "model.init_arch=llama is read only with model.family=text (model.family is 'flow')"),
        (["flow.steps=4"], "the flow section is set, but it is read only with model.family=flow"),
        (["model.family=flow", "data.task=shapes", "rollout.engine=vllm"],
         "rollout.engine=vllm: model.family=flow needs a step engine (its sampler runs the flow model's own "
         "denoising steps), and vllm is a token engine (vLLM serves language models); use "
         "rollout.engine torch"),
        (["model.family=flow", "data.task=shapes", "flow.noise_level=0"], "flow.noise_level must be >= 0.01"),
        (["model.family=flow", "data.task=shapes", "flow.noise_level=1e-6"],
         "flow.noise_level must be >= 0.01"),
        (["model.family=bandit"],
         "model.family must be one of 'text', 'flow', 'agent', got 'bandit'; plug-ins add more"),
        (["rollout.decoder=on"], "rollout.decoder must be one of 'auto', 'native', 'python'"),
        (["train.world_size=3", "rollout.batch_size=4", "train.updates_per_batch=2"],
         "leaves some with 2; raise rollout.batch_size"),
        (["train.world_size=2", "train.device=cuda:1"], "names one GPU"),
        (["rollout.backend=ray", "ray.learner=actor", "ray.learner_placement=STRICT_PACK"],
         "ray.learner_placement=STRICT_PACK places learner ranks, which exist only with"),
        (["rollout.backend=ray", "ray.learner_placement=pack"],
         "ray.learner_placement must be one of 'PACK', 'STRICT_PACK'"),
        (["rollout.backend=ray", "ray.learner_resources={trainer: 1}"],
         "ray.learner_resources places the learner's Ray actor, and ray.learner=driver; set "
         "ray.learner=actor"),
        (["rollout.backend=ray", "ray.worker_resources={CPU: 2}"],
         "ray.worker_resources names Ray's built-in resource 'CPU'; request it with ray.cpus_per_worker"),
        (["rollout.backend=ray", "ray.learner=actor", "ray.learner_resources={GPU: 1}"],
         "ray.learner_resources names Ray's built-in resource 'GPU'; request it with train.device"),
        (["rollout.backend=ray", "ray.worker_resources={sampler: 0}"],
         "ray.worker_resources['sampler'] must be > 0, got 0; remove the entry"),
        (["rollout.backend=ray", "ray.worker_resources=sampler"],
         "ray.worker_resources must be a mapping of strings to numbers, got 'sampler'"),
        (["rollout.backend=ray", "ray.worker_resources={sampler: many}"],
         "ray.worker_resources['sampler'] must be a number, got 'many'"),
        (["async.inflight_update=abort", "async.sync_when_idle=true"],
         "async.sync_when_idle has no effect with async.inflight_update=abort"),
        (["async.inflight_update=pause"], "async.inflight_update must be one of 'drain', 'keep'"),
        (["checkpoint.sharded=true"], "checkpoint.sharded=true has no effect with train.world_size=1"),
        (["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_draws=1000000"],
         "rollout.dynamic_sampling_max_draws must be <= 64, got 1000000"),
        (["rollout.engine=vllm", "vllm.dtype=auto"],
         "vllm.dtype must be one of 'float32', 'bfloat16', 'float16'"),
        (["rollout.engine=vllm", "vllm.gpu_memory_utilization=0"],
         "vllm.gpu_memory_utilization must be >= 0.05"),
        (["rollout.max_worker_restarts=0"],
         "rollout.on_worker_loss=replace with rollout.max_worker_restarts=0 would replace no worker; set "
         "rollout.max_worker_restarts to 1 or more, or rollout.on_worker_loss=stop"),
        (["rollout.on_worker_loss=stop", "rollout.max_worker_restarts=5"],
         "rollout.max_worker_restarts=5 has no effect with rollout.on_worker_loss=stop"),
        (["rollout.on_worker_loss=restart"], "rollout.on_worker_loss must be one of 'replace', 'stop'"),
    ],
)
def test_cross_key_rules(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_the_decoder_reads_from_yaml_as_written(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  decoder: python\n")
    assert load_config(recipe).rollout.decoder == "python"
    assert load_config(None, ["rollout.decoder=native"]).rollout.decoder == "native"


def test_ray_resources_are_mappings_from_yaml_or_an_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  backend: ray\n"
                      "ray:\n  learner: actor\n  learner_resources:\n    trainer: 1\n")
    c = load_config(recipe, ['ray.worker_resources={sampler: 0.5, "node:10.0.0.2": 0.01}'])
    assert c.ray.learner_resources == {"trainer": 1.0}
    assert c.ray.worker_resources == {"sampler": 0.5, "node:10.0.0.2": 0.01}
    assert load_config(None, ["rollout.backend=ray"]).ray.worker_resources == {}


def test_gpu_rollout_actors_are_accepted_with_the_ray_backend():
    c = load_config(None, ["rollout.backend=ray", "ray.gpus_per_worker=0.5"])
    assert c.ray.gpus_per_worker == 0.5


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_every_inflight_mode_is_accepted_with_either_engine_and_either_backend(mode):
    for engine in ("torch", "vllm"):
        for backend in ("local", "ray"):
            c = load_config(None, [f"rollout.engine={engine}", f"rollout.backend={backend}",
                                   f"async.inflight_update={mode}"])
            assert (c.rollout.engine, c.rollout.backend, c.async_.inflight_update) == (engine, backend, mode)


def test_a_dataset_recipe_is_accepted():
    c = load_config(None, ["data.task=", "data.dataset=train.jsonl", "reward.function=exact_match",
                           "data.prompt_column=question"])
    assert (c.data.dataset, c.data.prompt_column, c.reward.function) == (
        "train.jsonl", "question", "exact_match")


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ("grpo", {"loss": "ppo_clip", "aggregation": "seq_mean_token_mean", "clip_low": 0.2, "clip_high": 0.2,
                  "adv_std_norm": True, "drop_zero_std": False, "kl_coef": 0.04, "kl_estimator": "k3"}),
        ("dapo", {"loss": "ppo_clip", "aggregation": "token_mean", "clip_low": 0.2, "clip_high": 0.28,
                  "adv_std_norm": True, "drop_zero_std": True, "kl_coef": 0.0}),
        ("dr_grpo", {"loss": "ppo_clip", "aggregation": "seq_mean_token_sum_norm", "adv_std_norm": False,
                     "kl_coef": 0.0}),
        ("gspo", {"loss": "gspo", "aggregation": "seq_mean_token_mean", "clip_low": 3e-4, "clip_high": 4e-4}),
        ("cispo", {"loss": "cispo", "aggregation": "token_mean", "clip_low": 1.0, "clip_high": 0.28}),
    ],
)
def test_presets_resolve_to_their_papers_settings(algorithm, expected):
    train = load_config(None, [f"train.algorithm={algorithm}"]).train
    assert {k: getattr(train, k) for k in expected} == expected


def test_an_explicit_key_wins_over_the_preset_and_is_recorded():
    cfg = load_config(None, ["train.algorithm=gspo", "train.clip_high=0.001"])
    assert (cfg.train.loss, cfg.train.clip_low, cfg.train.clip_high) == ("gspo", 3e-4, 0.001)
    assert "clip_high: 0.001" in cfg.to_yaml() and "loss: gspo" in cfg.to_yaml()
    with pytest.raises(ConfigError, match="must be one of 'grpo', 'dapo'"):
        load_config(None, ["train.algorithm=ppo"])
    with pytest.raises(ConfigError, match="valid ones are: grpo, dapo"):
        preset("ppo")


def test_overlong_keys_are_checked_against_the_completion_budget():
    cfg = load_config(None, ["rollout.max_new_tokens=16", "reward.overlong_buffer=4",
                             "reward.overlong_penalty=0.5", "train.mask_truncated=true"])
    r, t = cfg.reward, cfg.train
    assert (r.overlong_buffer, r.overlong_penalty, t.mask_truncated) == (4, 0.5, True)
    with pytest.raises(ConfigError, match=r"overlong_buffer=20 is longer than rollout\.max_new_tokens=16"):
        load_config(None, ["rollout.max_new_tokens=16", "reward.overlong_buffer=20"])
    with pytest.raises(ConfigError, match=r"overlong_penalty=0\.5 has no effect"):
        load_config(None, ["reward.overlong_penalty=0.5"])


def test_eval_samples_need_evaluation_on():
    assert load_config(None, ["eval.interval=5", "eval.num_samples=4"]).eval.num_samples == 4
    with pytest.raises(ConfigError, match=r"eval\.num_samples=4 has no effect with evaluation off"):
        load_config(None, ["eval.num_samples=4"])


def test_train_device_names_a_torch_device():
    for name in ("cpu", "cuda", "cuda:1"):
        assert load_config(None, [f"train.device={name}"]).train.device == name
    with pytest.raises(ConfigError, match=r"train\.device must be 'cpu', 'cuda' or 'cuda:N'.*got 'gpu'"):
        load_config(None, ["train.device=gpu"])


def test_correction_bounds_without_their_correction_are_refused():
    with pytest.raises(ConfigError, match=r"correction\.tis_cap=5 has no effect with correction\.tis=none"):
        load_config(None, ["correction.tis=none", "correction.tis_cap=5"])
    with pytest.raises(ConfigError, match=r"\(0\.2, 2\) have no effect with correction\.mask=none"):
        load_config(None, ["correction.mask_low=0.2"])
    c = load_config(None, ["correction.mask=token", "correction.mask_low=0.2"]).correction
    assert (c.mask, c.mask_low, c.mask_high) == ("token", 0.2, 2.0)


def test_the_advantage_estimator_owns_its_normalisation():
    assert load_config(None, ["train.advantage=rloo"]).train.adv_std_norm is False  # not the preset's
    assert load_config(None, ["train.advantage=grpo"]).train.adv_std_norm is True   # dapo's
    with pytest.raises(ConfigError, match=r"train\.adv_std_norm has no effect with train\.advantage=rloo"):
        load_config(None, ["train.advantage=rloo", "train.adv_std_norm=true"])
    with pytest.raises(ConfigError, match=r"adv_scope=batch has no effect with .*=reinforce_pp"):
        load_config(None, ["train.advantage=reinforce_pp", "train.adv_scope=batch"])
    with pytest.raises(ConfigError, match=r"grpo.*rloo.*reinforce_pp"):
        load_config(None, ["train.advantage=ppo"])


@pytest.mark.parametrize("algorithm", sorted(PRESETS))
@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_a_resolved_config_loads_again_as_itself(algorithm, advantage):
    # Every process of a run (rollout workers, learner ranks, a resume) rebuilds the config from
    # what the driver resolved: resolving must accept its own output and change nothing.
    # (train.advantage=rloo once wrote adv_std_norm: false and then refused it in the worker.)
    cfg = load_config(None, [f"train.algorithm={algorithm}", f"train.advantage={advantage}"])
    again = Config.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again.to_dict() == cfg.to_dict()
    assert pickle.loads(pickle.dumps(cfg)).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(("recorded", "overrides", "dropped"), [
    (["train.world_size=2", "checkpoint.sharded=true"], ["train.world_size=1"],
     ["checkpoint.sharded=True (it has no effect with train.world_size=1)"]),
    (["rollout.backend=ray", "ray.learner=actor", "ray.local_cpus=3", "train.world_size=2",
      "ray.learner_placement=STRICT_PACK"], ["rollout.backend=local", "train.world_size=1"],
     ["ray.local_cpus=3 (read only with rollout.backend=ray, and the resume sets rollout.backend=local)",
      "ray.learner=actor (read only with rollout.backend=ray, and the resume sets rollout.backend=local)",
      "ray.learner_placement=STRICT_PACK (read only with rollout.backend=ray, and the resume sets "
      "rollout.backend=local)"]),
    (["rollout.engine=vllm", "vllm.dtype=bfloat16"], ["rollout.engine=torch", "rollout.decoder=python"],
     ["vllm.dtype=bfloat16 (read only with rollout.engine=vllm, and the resume sets rollout.engine=torch)"]),
])
def test_a_resume_to_a_smaller_set_up_drops_the_recorded_keys_it_leaves_nothing_to_act_on(
        tmp_path, recorded, overrides, dropped):
    from tether.config import load_resumed

    path = tmp_path / "config.yaml"
    path.write_text(load_config(None, recorded).to_yaml())
    with pytest.raises(ConfigError):  # what a plain load of the run's config with them says
        load_config(path, overrides)
    cfg, said = load_resumed(path, overrides)
    assert said == dropped
    assert cfg.checkpoint.sharded is False and cfg.ray == load_config(None, []).ray
    # a key the resume sets itself is never dropped, and a wrong one is still refused
    with pytest.raises(ConfigError, match=r"checkpoint\.sharded=true has no effect"):
        load_resumed(path, [*overrides, "checkpoint.sharded=true"])


def test_a_familys_own_section_is_at_its_defaults_when_the_recipe_leaves_it_out():
    # the family's own checks read it while the recipe is being checked
    assert load_config(None, ["model.family=agent", "data.task=kv_lookup"]).env.max_turns == 4
    assert load_config(None, ["model.family=flow", "data.task=shapes"]).flow.steps == 8


def test_the_flow_grpo_preset_is_the_references_setting():
    t = load_config(None, ["model.family=flow", "data.task=shapes", "train.algorithm=flow_grpo"]).train
    assert (t.loss, t.aggregation, t.clip_low, t.clip_high) == ("ppo_clip", "token_mean", 1e-4, 1e-4)
    assert (t.adv_scope, t.adv_clip, t.kl_coef) == ("batch", 5.0, 0.04)
    other = load_config(None, ["train.algorithm=grpo"]).train
    assert (other.adv_scope, other.adv_clip) == ("group", 0.0)  # every other preset: per group, no clamp
    mine = load_config(None, ["train.algorithm=flow_grpo", "train.adv_clip=2"]).train
    assert mine.adv_clip == 2.0  # a key set in the recipe wins over the preset


FLOW = ["model.family=flow", "data.task=shapes"]


def test_the_flow_grpo_preset_sets_the_references_keys_that_have_defaults_of_their_own():
    """Flow-GRPO's reference (ac4c86e; docs/flow.md's table): the ratio against the sampler's
    log-probs, zero-advantage groups dropped, two updates a batch, AdamW 3e-4 / 1e-4, LoRA 32 / 64,
    and its timestep fraction 0.99 (the first int(0.99·T) steps)."""
    cfg = load_config(None, [*FLOW, "train.algorithm=flow_grpo", "flow.steps=10"])
    t = cfg.train
    assert (t.anchor, cfg.correction.tis, t.drop_zero_std) == ("behavior", "none", True)
    assert t.updates_per_batch == 2
    assert (t.lr, t.weight_decay, t.lora_rank, t.lora_alpha) == (3e-4, 1e-4, 32, 64.0)
    assert (t.ema_decay, t.ema_every) == (0.9, 8)
    assert (cfg.flow.train_steps, cfg.flow.train_step_choice) == (9, "first")  # int(9.9)
    assert cfg.flow.cfg_grad == "conditional"  # the reference at ac4c86e detaches the unconditional branch
    assert load_config(None, [*FLOW, "train.algorithm=flow_grpo", "flow.steps=1"]).flow.train_steps == 1
    # every other preset leaves those keys at their defaults
    other = load_config(None, [*FLOW, "train.algorithm=grpo"])
    assert (other.train.anchor, other.train.lr, other.train.lora_rank, other.train.updates_per_batch,
            other.correction.tis, other.train.ema_decay) == ("proximal", 1e-6, 0, 1, "token", 0.0)
    assert (other.flow.train_steps, other.flow.train_step_choice, other.flow.cfg_grad) == (
        0, "random", "full")


def test_with_an_sde_window_the_flow_grpo_preset_trains_the_whole_window():
    """Flow-GRPO-Fast trains every step of its window: the preset's int(0.99·T) would exceed a
    window of K < T steps and be refused, so with a window it leaves flow.train_steps at 0."""
    cfg = load_config(None, [*FLOW, "train.algorithm=flow_grpo", "flow.steps=8", "flow.sde_window=2"])
    assert (cfg.flow.train_steps, cfg.flow.sde_window) == (0, 2)
    assert not cfg.family().notes(cfg)  # the preset's own steps: nothing to say at start
    named = load_config(None, [*FLOW, "train.algorithm=flow_grpo", "flow.steps=8", "flow.sde_window=2",
                               "flow.train_steps=1"])
    assert named.flow.train_steps == 1


def test_same_latent_with_groups_of_one_is_noted_as_having_no_effect():
    alone = load_config(None, [*FLOW, "flow.same_latent=true", "rollout.group_size=1",
                               "train.advantage=reinforce_pp"])  # a batch-wide baseline
    [note] = [n for n in alone.family().notes(alone) if n.code == "same_latent_alone"]
    assert "rollout.group_size=1" in note.message
    grouped = load_config(None, [*FLOW, "flow.same_latent=true", "rollout.group_size=4"])
    assert "same_latent_alone" not in [n.code for n in grouped.family().notes(grouped)]


def test_a_key_the_recipe_names_wins_over_the_flow_grpo_preset_even_at_its_default():
    mine = load_config(None, [*FLOW, "train.algorithm=flow_grpo", "train.anchor=proximal",
                              "correction.tis=token", "train.lr=1e-6", "train.lora_rank=0",
                              "flow.train_steps=0", "flow.train_step_choice=random",
                              "train.updates_per_batch=1", "flow.cfg_grad=full"])
    assert (mine.train.anchor, mine.correction.tis, mine.train.lr, mine.train.lora_rank) == (
        "proximal", "token", 1e-6, 0)
    assert (mine.flow.train_steps, mine.flow.train_step_choice, mine.flow.cfg_grad) == (0, "random", "full")
    assert mine.train.updates_per_batch == 1
    # the preset's other keys still apply, and the resolved config (as a run records it and every
    # process rebuilds it) resolves to itself
    assert (mine.train.weight_decay, mine.train.drop_zero_std) == (1e-4, True)
    assert Config.from_dict(mine.to_dict()) == mine
    resolved = load_config(None, [*FLOW, "train.algorithm=flow_grpo"])
    assert Config.from_dict(resolved.to_dict()) == resolved
    # the recipe's own steps stand, and the run says so when it starts
    said = [n.code for n in mine.family().notes(mine)]
    assert "not_the_reference_steps" in said and not resolved.family().notes(resolved)
    # a key that follows another stays at its default when the recipe names that one
    own = load_config(None, [*FLOW, "train.algorithm=flow_grpo", "train.anchor=proximal",
                             "train.lora_rank=8"])
    assert (own.correction.tis, own.train.lora_alpha) == ("token", 16.0)


@pytest.mark.parametrize(("override", "says"), [
    ("flow.cfg_grad=half", "flow.cfg_grad must be one of 'full', 'conditional'"),
    ("flow.init_cond_dropout=1", "flow.init_cond_dropout must be <= 0.9"),
    ("flow.init_cond_dropout=-0.1", "flow.init_cond_dropout must be >= 0"),
])
def test_nonsense_flow_guidance_keys_are_refused_naming_the_key(override, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, [*FLOW, override])


def test_an_ema_decay_of_one_or_an_interval_without_an_ema_is_refused():
    with pytest.raises(ConfigError, match=r"train\.ema_decay=1\.0.*below 1"):
        load_config(None, ["train.ema_decay=1.0"])
    with pytest.raises(ConfigError, match=r"train\.ema_every=8 has no effect with train\.ema_decay=0"):
        load_config(None, ["train.ema_every=8"])
    own = load_config(None, [*FLOW, "train.algorithm=flow_grpo", "train.ema_decay=0"])
    assert (own.train.ema_decay, own.train.ema_every) == (0.0, 1)  # ema_every follows ema_decay
