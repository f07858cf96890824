"""Where rollout workers run (``rollout.backend``): one folder per backend, each holding its
plug-in (``__init__.py``: a ``tether.plugins.BackendPlugin`` declaring its section, keys, weight
channel, where its workers sample and its checks) and its pool (``pool.py``, a
``tether.vocabulary.RolloutPool`` over ``tether.rollout.dispatch.DispatchingPool``, imported only
when a run builds it).

    local/  worker processes of this machine, weights through shared memory (``ProcessPool``)
    ray/    Ray actors, weights through Ray's object store (``RayPool``); its section ``ray``,
            and the watchdog that takes a local Ray instance down with the run (``reaper``)
"""
