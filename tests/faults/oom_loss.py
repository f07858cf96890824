"""A plug-in loss that runs out of memory at its Nth call in a process (``OOM_AT_CALL``; 0 or unset:
never), as a learner whose update no longer fits would: the learner's out-of-memory path, provoked
deterministically on the CPU. With ``KILL_RANK_AT_CALL`` learner rank 1 is killed with SIGKILL at
that call instead, as the kernel's out-of-memory killer ends a process; with ``KILL_AT_CALL``
whichever process calls it. Otherwise it is ``ppo_clip``."""

import os
import signal

import tether
from tether import registry

calls = 0


@tether.register_loss("oom_at")
def oom_at(inputs, settings):
    global calls
    calls += 1
    if calls == int(os.environ.get("KILL_RANK_AT_CALL", "0")):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    if calls == int(os.environ.get("KILL_AT_CALL", "0")):  # the process the learner is in
        os.kill(os.getpid(), signal.SIGKILL)
    if calls == int(os.environ.get("OOM_AT_CALL", "0")):
        raise MemoryError("provoked by tests/integration/oom_loss.py")
    return registry.losses.get("ppo_clip")(inputs, settings)
