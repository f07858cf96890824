"""The EMA of the trained weights (train.ema_decay) against the reference's recurrence written out
by hand: Flow-GRPO's flow_grpo/ema.py folds θ in after optimizer step n when (n + 1) is a multiple
of the interval, with decay min((1 + n)/(10 + n), decay)."""

import pytest

torch = pytest.importorskip("torch")

from tether.errors import ConfigError  # noqa: E402
from tether.train.ema import Ema, decay_at  # noqa: E402


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    net[1].bias.requires_grad_(False)  # frozen: not averaged
    return net


def test_the_average_follows_the_references_recurrence_with_its_warm_up():
    net = model()
    ema = Ema(net, decay=0.9, every=3)
    trained = {n: p for n, p in net.named_parameters() if p.requires_grad}
    expected = {n: p.detach().clone() for n, p in trained.items()}
    folded = []
    for n in range(40):
        with torch.no_grad():
            for p in trained.values():
                p.add_(torch.randn_like(p))  # an "update"
        folded.append(ema.step(n))
        if (n + 1) % 3 == 0:
            d = min((1 + n) / (10 + n), 0.9)
            expected = {k: d * v + (1 - d) * trained[k].detach() for k, v in expected.items()}
    assert folded == [(n + 1) % 3 == 0 for n in range(40)]
    assert set(ema.values) == {"0.weight", "0.bias", "1.weight"}
    for name, value in expected.items():
        torch.testing.assert_close(ema.values[name], value, rtol=1e-6, atol=1e-6)
    assert [decay_at(n, 0.9) for n in (0, 8, 80, 81, 1000)] == [0.1, 9 / 18, 0.9, 0.9, 0.9]


def test_swapped_in_holds_the_average_inside_and_the_trained_weights_exactly_after():
    net = model()
    ema = Ema(net, decay=0.5, every=1)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)
    ema.step(50)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    with ema.swapped_in():
        for name, p in net.named_parameters():
            expected = ema.values.get(name, before[name])  # the frozen bias is not swapped
            assert torch.equal(p, expected)
        assert not torch.equal(net[0].weight, before["0.weight"])
    for name, p in net.named_parameters():
        assert torch.equal(p, before[name])
    with pytest.raises(RuntimeError), ema.swapped_in():  # restored even when evaluation fails
        raise RuntimeError("an evaluation failed")
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


def test_an_average_of_other_parameters_is_refused_naming_them():
    ema = Ema(model(), decay=0.9, every=1)
    state = {n: v.clone() for n, v in ema.values.items()}
    ema.load(state, "here")
    state.pop("0.bias")
    with pytest.raises(ConfigError, match=r"here: its EMA does not match.*missing \['0.bias'\]"):
        ema.load(state, "here")
