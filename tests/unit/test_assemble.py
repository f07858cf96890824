"""The composition root: which parts a recipe chooses, and what they cost on this machine."""

from tether.config import load_config
from tether.runtime.assemble import assemble, learner_layout


def test_the_learner_layout_follows_the_recipe():
    assert learner_layout(load_config(None, [])) == "process"
    assert learner_layout(load_config(None, ["train.world_size=2"])) == "ranks"
    assert learner_layout(load_config(None, ["rollout.backend=ray", "ray.learner=actor"])) == "actor"
    parts = assemble(load_config(None, ["rollout.backend=ray"]))
    assert (parts.family.name, parts.backend.name, parts.engine.name, parts.layout) == (
        "text", "ray", "torch", "process")


def test_a_layout_that_wants_more_threads_than_cpus_says_what_it_costs():
    from tether.runtime.assemble import assemble

    def notes(*overrides, cpus=2):
        return assemble(load_config(None, list(overrides))).notes(cpus=cpus)

    assert notes() == []  # the demo's split: one thread each for the learner and the worker
    (note,) = notes("train.world_size=8")
    assert note.code == "oversubscribed"
    assert note.message.startswith("8 learner ranks × train.threads=1 and 1 rollout worker(s)")
    assert "want 9 threads on 2 CPUs" in note.message
    assert notes("train.world_size=8", cpus=16) == []
    # a cluster's Ray actors run elsewhere: nothing to say about this machine
    assert notes("rollout.backend=ray", "ray.address=auto", "ray.learner=actor", "train.world_size=8") == []
