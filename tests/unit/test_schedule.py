"""The learning-rate schedule: warm-up, then constant, linear or cosine decay to a floor."""

import dataclasses
import itertools
import math

import pytest

from tether.config import load_config
from tether.errors import ConfigError
from tether.train.schedule import lr_factor


def factors(kind, *, warmup=2, total=10, min_ratio=0.1):
    return [lr_factor(k, kind=kind, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio)
            for k in range(12)]


def test_warm_up_is_linear_from_the_first_update():
    # W = 2: updates 0 and 1 run at 1/2 and 2/2 of the rate, whatever the decay after
    for kind in ("constant", "linear", "cosine"):
        assert factors(kind)[:2] == [0.5, 1.0]


def test_constant_holds_the_rate():
    assert factors("constant", min_ratio=0.0)[2:] == [1.0] * 10


def test_linear_reaches_the_floor_at_the_last_planned_update():
    # p = (k − 2) / 8; f = 0.1 + 0.9 (1 − p): k = 6 → p = ½ → 0.55; k = 10 → 0.1, and it stays there
    f = factors("linear")
    assert f[2] == pytest.approx(1.0) and f[6] == pytest.approx(0.55)
    assert f[10] == pytest.approx(0.1) and f[11] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(f[2:]))


def test_cosine_is_half_way_at_mid_run():
    # k = 6 → p = ½ → cos(π/2) = 0 → f = 0.1 + 0.9 · ½ = 0.55; k = 4 → p = ¼ → 0.1 + 0.45 (1 + √½)
    f = factors("cosine")
    assert f[6] == pytest.approx(0.55)
    assert f[4] == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert f[10] == pytest.approx(0.1) and f[11] == pytest.approx(0.1)


def test_no_warm_up_starts_at_the_full_rate():
    assert lr_factor(0, kind="cosine", warmup_steps=0, total_steps=4, min_ratio=0.0) == 1.0
    assert lr_factor(4, kind="cosine", warmup_steps=0, total_steps=4, min_ratio=0.0) == pytest.approx(0.0)


def test_unknown_schedule_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        lr_factor(0, kind="step", warmup_steps=0, total_steps=1, min_ratio=0.0)


def test_config_refuses_keys_that_would_do_nothing():
    assert load_config(None, ["train.lr_schedule=cosine", "train.min_lr_ratio=0.1"]).train.min_lr_ratio == 0.1
    with pytest.raises(ConfigError, match=r"no effect with train\.lr_schedule=constant"):
        load_config(None, ["train.min_lr_ratio=0.1"])
    with pytest.raises(ConfigError, match=r"would never reach train\.lr"):
        load_config(None, ["train.num_batches=5", "train.updates_per_batch=2", "train.warmup_steps=11"])
    with pytest.raises(ConfigError, match="must be one of 'constant', 'linear', 'cosine'"):
        load_config(None, ["train.lr_schedule=exp"])


def test_config_refuses_a_warm_start_floor_without_a_decay():
    cfg = load_config(None, ["warmstart.lr_schedule=cosine", "warmstart.min_lr_ratio=0.1"])
    assert (cfg.warmstart.lr_schedule, cfg.warmstart.min_lr_ratio) == ("cosine", 0.1)
    with pytest.raises(ConfigError, match=r"no effect with warmstart\.lr_schedule=constant"):
        load_config(None, ["warmstart.min_lr_ratio=0.1"])


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_the_warm_start_decays_over_its_steps(kind):
    # the rate each step's loss is taken under: from warmstart.lr at step 1 to lr × m at max_steps
    import torch

    from tether.train.supervised import warmstart_loop

    cfg = load_config(None, [f"warmstart.lr_schedule={kind}", "warmstart.max_steps=5", "warmstart.lr=0.01",
                             "warmstart.target_pass_rate=1", "warmstart.eval_every=5"]
                      + ([] if kind == "constant" else ["warmstart.min_lr_ratio=0.2"]))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart.lr)
    seen = []

    def loss_at(step):
        seen.append(optimizer.param_groups[0]["lr"])
        return model(torch.ones(1, 2)).sum()

    result = warmstart_loop(model, optimizer, loss_at, lambda: {"pass_at_1": 0.0}, cfg.warmstart, data="test")
    assert result.steps == 5
    expected = {"constant": [1, 1, 1, 1, 1], "linear": [1, 0.8, 0.6, 0.4, 0.2],
                "cosine": [1, 0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2, 0.6,
                           0.2 + 0.8 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.2]}[kind]
    assert seen == pytest.approx([0.01 * f for f in expected])


def test_a_model_built_before_the_warm_start_schedule_reads_as_constant(tmp_path):
    # a record without lr_schedule was built at a constant rate: a recipe asking for a decay is told
    import json

    from tether.data.prepare import built_otherwise

    cfg = load_config(None, ["warmstart.lr_schedule=cosine", "warmstart.min_lr_ratio=0.1"])
    newer = ("lr_schedule", "min_lr_ratio")
    settings = {k: v for k, v in dataclasses.asdict(cfg.warmstart).items() if k not in newer}
    (tmp_path / "warmstart.json").write_text(json.dumps({"settings": {**settings, "seed": cfg.run.seed}}))
    assert built_otherwise(cfg, tmp_path) == [
        "warmstart.lr_schedule: built with constant, the recipe says cosine",
        "warmstart.min_lr_ratio: built with 0.0, the recipe says 0.1"]
    assert built_otherwise(cfg, tmp_path / "elsewhere") == []  # not a model Tether built: nothing to compare


def test_build_keys_set_for_a_model_tether_did_not_build_are_named(tmp_path):
    # a model without warmstart.json is used as it is: the recipe's build keys do nothing
    import json

    from tether.data.prepare import unbuilt_keys

    cfg = load_config(None, ["warmstart.target_pass_rate=0.2", "warmstart.eval_every=5",
                             "model.init_size=tiny"])
    assert unbuilt_keys(cfg, tmp_path) == ["warmstart.target_pass_rate=0.2", "warmstart.eval_every=5",
                                           "model.init_size=tiny"]
    assert unbuilt_keys(load_config(None, []), tmp_path) == []  # the defaults: nothing set
    (tmp_path / "warmstart.json").write_text(json.dumps({"settings": {"seed": 0}}))
    assert unbuilt_keys(cfg, tmp_path) == []  # a model Tether built: built_otherwise compares it
