"""The rollout-batch FIFO: order, bounds, timeouts, close, and first-error propagation."""

import threading
import time

import pytest

from tether.control import BatchQueue
from tether.errors import QueueClosedError, QueueTimeoutError, RolloutError


def test_fifo_order_and_drain():
    q = BatchQueue(4)
    for i in range(3):
        q.put(i)
    assert q.get() == 0
    assert q.drain() == [1, 2]
    assert len(q) == 0


def test_bad_maxsize_is_rejected():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            BatchQueue(bad)


def test_get_times_out_when_empty_and_put_when_full():
    q = BatchQueue(1)
    with pytest.raises(QueueTimeoutError, match="get timed out"):
        q.get(timeout=0.05)
    q.put("a")
    with pytest.raises(QueueTimeoutError, match="put timed out"):
        q.put("b", timeout=0.05)


@pytest.mark.timeout(10)
def test_put_blocks_until_a_get_makes_room():
    q = BatchQueue(1)
    q.put(1)
    done = threading.Event()

    def producer():
        q.put(2, timeout=5)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.05)
    assert not done.is_set()
    assert q.get(timeout=5) == 1
    t.join(5)
    assert done.is_set()
    assert q.get(timeout=5) == 2


@pytest.mark.timeout(10)
def test_close_wakes_every_waiter():
    q = BatchQueue(1)
    errors = []

    def waiter():
        try:
            q.get(timeout=5)
        except QueueClosedError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    q.close()
    for t in threads:
        t.join(5)
    assert len(errors) == 3
    with pytest.raises(QueueClosedError):
        q.put(1)


def _fail():
    raise ValueError("reward function exploded")


@pytest.mark.timeout(10)
def test_first_error_reaches_the_waiter_with_its_traceback():
    q = BatchQueue(2)
    got = []

    def consumer():
        try:
            q.get(timeout=5)
        except RolloutError as exc:
            got.append(exc)

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.05)
    try:
        _fail()
    except ValueError as exc:
        q.report_error(exc)
    q.report_error(RuntimeError("second error is ignored"))
    t.join(5)
    (exc,) = got
    assert "ValueError: reward function exploded" in str(exc)
    assert "_fail" in exc.remote_traceback  # the original frame is in the traceback text
    assert isinstance(exc.__cause__, ValueError)
    # every later call re-raises the first error, even after close (errors beat closed)
    q.close()
    with pytest.raises(RolloutError, match="exploded"):
        q.put(1)
    with pytest.raises(RolloutError, match="exploded"):
        q.drain()


def test_a_rollout_error_is_reraised_as_itself():
    q = BatchQueue(1)
    original = RolloutError("boom", worker="w3", batch_index=5)
    q.report_error(original)
    with pytest.raises(RolloutError) as info:
        q.get(timeout=1)
    assert info.value is original
    assert "worker w3, batch 5: boom" in str(info.value)
