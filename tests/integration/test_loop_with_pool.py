"""The real driver loop over real rollout workers: staleness read from the tokens' version stamps
matches the virtual-time plan for the same settings."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from configs import pool_settings  # noqa: E402
from tether.control import AsyncControl, BudgetSettings  # noqa: E402
from tether.data.stream import PromptStream  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.loop import Driver, Timings, TraceRecorder, TrainResult, simulate, summarize  # noqa: E402
from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.backends.local.pool import ProcessPool  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


class PerturbLearner:
    """Moves real weights a little per update, so published versions are real, different weights."""

    def __init__(self, model, updates_per_batch):
        self.model = model
        self.u = updates_per_batch
        self.seen = []  # (train version, oldest token version, newest token version)

    def train(self, batch, *, train_version):
        versions = [v for vs in batch.payload.versions for v in vs]
        self.seen.append((train_version, min(versions), max(versions)))
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        return TrainResult(self.u, self.u, {})

    def export_weights(self):
        return unique_parameters(self.model)


@pytest.mark.parametrize(("s", "u"), [(0, 1), (1, 2), (2, 1)])
def test_measured_staleness_and_publications_match_the_plan(tiny_model_dir, s, u):
    settings = BudgetSettings(max_staleness=s, updates_per_batch=u, max_inflight=s + 1,
                              total_batches=3 * (s + 1))
    model, _ = load_causal_lm(tiny_model_dir)
    stream = PromptStream(get_task("arithmetic").examples("train", 200), batch_size=2)
    learner = PerturbLearner(model, u)
    trace = TraceRecorder()
    settings_ = pool_settings(tiny_model_dir, "rollout.num_workers=2", "rollout.group_size=2",
                              "rollout.max_new_tokens=4")
    with ProcessPool(settings_, stream.batch, unique_parameters(model)) as pool:
        Driver(AsyncControl(settings), pool, learner, observer=trace, wait_timeout_s=60).run()
    measured = [tv - oldest for tv, oldest, _newest in learner.seen]
    assert all(oldest == newest for _tv, oldest, newest in learner.seen)  # no mid-sample update
    plan = simulate(settings, Timings())
    assert measured == [r.staleness_updates for r in plan.trace.records]
    published = [e.detail["step"] for e in trace.of_kind("sync") if e.detail["published"]]
    assert published == summarize(plan)["syncs_after"]
    if s == 0:
        assert measured == [0] * settings.total_batches
    assert max(measured) == s * u
