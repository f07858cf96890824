"""A plug-in loss that runs out of memory at its Nth call in a process (``OOM_AT_CALL``; 0 or unset:
never), as a learner whose update no longer fits would: the learner's out-of-memory path, provoked
deterministically on the CPU. Otherwise it is ``ppo_clip``."""

import os

import tether
from tether import registry

calls = 0


@tether.register_loss("oom_at")
def oom_at(inputs, settings):
    global calls
    calls += 1
    if calls == int(os.environ.get("OOM_AT_CALL", "0")):
        raise MemoryError("provoked by tests/integration/oom_loss.py")
    return registry.losses.get("ppo_clip")(inputs, settings)
