"""The weight channel round trip, its verification, and an engine bound to it."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tether.modeling import load_causal_lm, unique_parameters  # noqa: E402
from tether.rollout.channel import ChannelError, WeightChannel, WeightReader  # noqa: E402
from tether.rollout.engines.torch.engine import TorchEngine  # noqa: E402
from tether.vocabulary import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def channel_and_params(tiny_model_dir):
    model, _tok = load_causal_lm(tiny_model_dir)
    params = unique_parameters(model)
    channel = WeightChannel.for_tensors(params)
    reader = WeightReader(channel.name, channel.layout)
    yield channel, reader, params, model
    reader.close()
    channel.close()


def test_round_trip_is_exact_and_reports_metrics(channel_and_params):
    channel, reader, params, _ = channel_and_params
    metrics = channel.publish(params, 3)
    assert reader.verify(3) >= 0
    views = reader.views()
    assert set(views) == set(params)
    for name, t in params.items():
        assert torch.equal(views[name], t), name
    assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in params.values())
    assert metrics["sync/publish_s"] > 0


def test_verification_catches_version_corruption_and_torn_writes(channel_and_params):
    channel, reader, params, _ = channel_and_params
    channel.publish(params, 1)
    with pytest.raises(ChannelError, match="holds version 1, expected 2"):
        reader.verify(2)
    name = next(iter(params))
    reader.views()[name].view(-1)[0] += 1.0  # a stray write after publishing
    with pytest.raises(ChannelError, match="fail their checksum"):
        reader.verify(1)
    channel.publish(params, 2)
    channel._block.header[0] = 0  # as if the publisher died mid-write
    with pytest.raises(ChannelError, match="incomplete"):
        reader.verify(2)


def _awkward_tensors() -> dict[str, torch.Tensor]:
    """Sizes that end inside a word, dtypes of every width, a transposed view, negative words."""
    g = torch.Generator().manual_seed(0)
    return {"odd_half": torch.randn(7, generator=g).half(),
            "bytes": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
            "float": torch.randn(64, 33, generator=g),
            "transposed": torch.randn(9, 5, generator=g).t(),
            "empty": torch.empty(0),
            "big_negative": torch.full((3,), -1, dtype=torch.int64) * (2 ** 62),
            "double": torch.randn(5, dtype=torch.float64, generator=g)}


def test_the_one_pass_copy_and_checksum_writes_and_sums_what_a_copy_then_a_sum_does(monkeypatch):
    from tether.decoding import native

    if native.helpers() is None:
        pytest.skip("the native library cannot be built here")
    tensors = _awkward_tensors()
    blocks = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(native, "helpers", lambda: None)
        channel = WeightChannel.for_tensors(tensors)
        try:
            channel.publish(tensors, 5)
            channel.verify(5)  # the recorded checksum is the block's own sum
            blocks[fused] = torch.frombuffer(channel._block.shm.buf, dtype=torch.uint8,
                                             count=channel.layout.total_bytes).clone()
            for name, t in tensors.items():
                assert torch.equal(channel.views()[name], t), name
        finally:
            channel.close()
    assert torch.equal(blocks[True], blocks[False])


def test_publishing_the_wrong_tensors_is_refused(channel_and_params):
    channel, _reader, params, _ = channel_and_params
    partial = dict(list(params.items())[:-1])
    with pytest.raises(ChannelError, match="do not match the channel layout"):
        channel.publish(partial, 1)


def test_bound_engine_samples_the_published_weights_and_stamps_their_version(tiny_model_dir,
                                                                            channel_and_params):
    channel, reader, params, trainer = channel_and_params
    channel.publish(params, 0)
    model, tok = load_causal_lm(tiny_model_dir)
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    engine.bind(reader.views())
    prompts = [tok("12+34=", add_special_tokens=False).input_ids]
    params_s = SamplingParams(max_new_tokens=8)

    def draw():
        return engine.generate(prompts, samples_per_prompt=4, params=params_s, seed=11)[0]

    before = draw()
    assert draw() == before  # seeded: same weights, same tokens
    assert all(c.versions == [0] * len(c.token_ids) for c in before)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    channel.publish(unique_parameters(trainer), 5)
    reader.verify(5)
    engine.load_weights(reader.views(), 5)
    after = draw()
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert all(c.versions == [5] * len(c.token_ids) for c in after)
    assert engine.version == 5


def test_engine_refuses_prompts_past_the_context(tiny_model_dir):
    from tether.errors import ConfigError

    model, tok = load_causal_lm(tiny_model_dir)
    engine = TorchEngine(model, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    with pytest.raises(ConfigError, match="exceeds the model's context of 256 positions"):
        engine.generate([[5] * 250], samples_per_prompt=1, params=SamplingParams(max_new_tokens=10), seed=0)


def test_an_object_store_snapshot_round_trips_and_is_verified(channel_and_params):
    from tether.rollout.channel import Snapshot, open_snapshot

    _channel, _reader, params, _ = channel_and_params
    snap = Snapshot.for_tensors(params)
    metrics = snap.write(params, 4)
    assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in params.values())
    fetched = snap.array.copy()
    fetched.flags.writeable = False  # as an object store hands it out
    views, seconds = open_snapshot(fetched, snap.layout, 4)
    assert seconds >= 0 and set(views) == set(params)
    assert all(torch.equal(views[n], t) for n, t in params.items())
    with pytest.raises(ChannelError, match="holds version 4, expected 5"):
        open_snapshot(fetched, snap.layout, 5)
    torn = snap.array.copy()
    torn[-8] ^= 0xFF  # one flipped byte in the last tensor
    with pytest.raises(ChannelError, match="fail their checksum"):
        open_snapshot(torn, snap.layout, 4)
    with pytest.raises(ChannelError, match=r"expected .* bytes of uint8"):
        open_snapshot(fetched[:-64], snap.layout, 4)


def test_a_stop_signal_while_a_channel_is_made_waits_until_the_block_is_owned():
    """A stop signal's handler raises where it lands; landing between the shared block's creation
    and its owner (before the resource tracker even knows the name) would leak it. Deferred, it
    lands after the channel is held, where the owner's clean-up can unlink it."""
    import os
    import signal
    import time

    from tether.procinfo import stop_signals_deferred

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGINT, handler)
    made = None
    try:
        with pytest.raises(Stop), stop_signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # undeferred, the handler would raise here
            made = WeightChannel.for_tensors({"w": torch.ones(4)})
        assert made is not None and os.path.exists(f"/dev/shm/{made.name}")
    finally:
        signal.signal(signal.SIGINT, previous)
        if made is not None:
            made.close()
    assert not os.path.exists(f"/dev/shm/{made.name}")
