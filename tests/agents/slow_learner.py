"""A learner that takes its time, as a real one does: ``train.advantage=slow_grpo`` is GRPO's
advantages after ``DELAY_S`` seconds (a plug-in file, named in ``run.plugins``)."""

import time

from tether import register_advantage
from tether.train.advantages import grpo

DELAY_S = 0.6


@register_advantage("slow_grpo", std_norm=True)
def slow_grpo(r, *, std_norm, scope, eps):
    time.sleep(DELAY_S)
    return grpo(r, std_norm=std_norm, scope=scope, eps=eps)
