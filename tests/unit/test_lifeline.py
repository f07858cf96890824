"""A process tied to another by a lifeline pipe (``procinfo.exit_when_closed``) exits the moment
the pipe closes: it unlinks the named semaphores it made first, and nothing it is doing — not
even holding the resource tracker's lock, which that clean-up needs — holds the exit up."""

import multiprocessing
import os
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def _child(lifeline_r, lifeline_w, report, hold_tracker_lock):
    from multiprocessing import resource_tracker

    from tether.procinfo import exit_when_closed

    lifeline_w.close()
    lock = multiprocessing.get_context("forkserver").Lock()  # a named semaphore, registered
    exit_when_closed(lifeline_r.fileno())
    report.send(lock._semlock.name)
    if hold_tracker_lock:
        resource_tracker._resource_tracker._lock.acquire()
    time.sleep(60)


@pytest.mark.parametrize("hold", [False, True], ids=["idle", "holding-the-tracker-lock"])
def test_a_closed_lifeline_unlinks_the_semaphores_and_exits_at_once(hold):
    ctx = multiprocessing.get_context("forkserver")
    lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
    report_r, report_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(lifeline_r, lifeline_w, report_w, hold), daemon=True)
    proc.start()
    lifeline_r.close()
    report_w.close()
    assert report_r.poll(30), "the child did not start"
    name = report_r.recv()
    time.sleep(0.2)  # the child is asleep (holding the lock, when asked)
    lifeline_w.close()
    proc.join(30)  # the child would sleep 60 s: alive here, its exit was held up
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive and proc.exitcode == 0, proc.exitcode
    left = os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}")
    if not hold:  # unlinked by the child itself: gone before any tracker could get to it
        assert not left
    elif left:  # the clean-up was cut short by the guard: ours to do, so the tracker has no warning
        import _multiprocessing
        from multiprocessing import resource_tracker

        _multiprocessing.sem_unlink(name)
        resource_tracker.unregister(name, "semaphore")


def test_a_folder_of_marks_is_removed_while_a_thread_still_writes_marks_into_it(tmp_path):
    """The lifeline removes the phase marks' folder while the main thread may be marking a phase
    (``tether.train.memory._mark``); a mark written in between must not leave the folder behind."""
    import threading

    from tether.procinfo import remove_marks
    from tether.train.memory import _mark

    for attempt in range(40):
        folder = tmp_path / f"marks-{attempt}"
        folder.mkdir()
        for i in range(50):
            (folder / str(i)).write_text("phase")
        stop = threading.Event()
        marks = str(folder)
        writer = threading.Thread(target=lambda f=marks, s=stop: [_mark(f) for _ in iter(s.is_set, True)])
        writer.start()
        remove_marks(str(folder))
        stop.set()
        writer.join(10)
        assert not folder.exists() and not (tmp_path / f"marks-{attempt}.gone").exists(), attempt
