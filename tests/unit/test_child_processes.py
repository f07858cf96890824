"""Rollout workers and learner ranks start from one fork server (``procinfo.child_context``): a
child gets the environment its parent has when the child starts — not the server's, from when the
server started — and a kernel name that ``ps`` shows."""

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _report(conn) -> None:
    conn.send((os.environ.get("TETHER_TEST_LATE"), Path("/proc/self/comm").read_text().strip(), os.getcwd()))
    conn.close()


def test_a_child_has_the_parents_environment_at_its_start_and_its_name(tmp_path, monkeypatch):
    from tether.procinfo import child_context, start_child, start_child_server

    start_child_server()  # the server starts (or runs already) before the variable is set
    ctx = child_context()
    monkeypatch.setenv("TETHER_TEST_LATE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ours, theirs = ctx.Pipe(duplex=False)
    proc = start_child(ctx, _report, (theirs,), name="tether-rank-7")
    theirs.close()
    assert ours.poll(60), "the child did not report"
    late, comm, cwd = ours.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert late == "set after the server started"
    assert comm == "tether-rank-7"
    assert cwd == str(tmp_path)
    monkeypatch.delenv("TETHER_TEST_LATE")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = start_child(ctx, _report, (theirs,), name="tether-worker-12")  # past 15 characters: cut
    theirs.close()
    assert ours.poll(60)
    late, comm, _ = ours.recv()
    proc.join(30)
    assert late is None and comm == "tether-worker-1"


def _signals(conn) -> None:
    import signal

    conn.send([signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)])
    conn.close()


def _child_signals(ctx) -> list:
    from tether.procinfo import start_child

    ours, theirs = ctx.Pipe(duplex=False)
    proc = start_child(ctx, _signals, (theirs,), name="tether-test")
    theirs.close()
    assert ours.poll(60), "the child did not report"
    got = ours.recv()
    proc.join(30)
    assert proc.exitcode == 0
    return got


@pytest.fixture
def signals_restored():
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_the_fork_server_outlives_a_sigterm_to_the_process_group_and_children_keep_theirs(signals_restored):
    """A SIGTERM or SIGHUP to a run's whole process group must not end the server: multiprocessing
    would then report every child it forked as exited (status 255) while they still ran. Its
    children start with both signals as a program the parent started would: at their defaults
    where the parent has them at their defaults or handles them, ignored where it ignores them
    (a run under nohup keeps its workers through a closed terminal)."""
    import signal
    import time
    from multiprocessing import forkserver

    from tether.procinfo import child_context, start_child_server

    dfl, ign = signal.SIG_DFL, signal.SIG_IGN
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as pytest may have been started (nohup ignores SIGHUP)
        signal.signal(sig, dfl)
    start_child_server()
    ctx = child_context()
    assert _child_signals(ctx) == [dfl, dfl]  # the server is up once it forks
    server = forkserver._forkserver._forkserver_pid
    for sig in (signal.SIGTERM, signal.SIGHUP):
        os.kill(server, sig)
    time.sleep(0.5)
    assert Path(f"/proc/{server}").exists() and "Z" not in Path(f"/proc/{server}/stat").read_text().split()[2]
    assert _child_signals(ctx) == [dfl, dfl]
    signal.signal(signal.SIGHUP, ign)  # under nohup
    signal.signal(signal.SIGTERM, lambda *_: None)  # a handler does not carry to a child
    assert _child_signals(ctx) == [dfl, ign]
    signal.signal(signal.SIGTERM, ign)
    signal.signal(signal.SIGHUP, dfl)
    assert _child_signals(ctx) == [ign, dfl]


def test_importing_the_servers_module_elsewhere_changes_no_signal(signals_restored):
    import importlib
    import signal

    import tether.fork_server

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    importlib.reload(tether.fork_server)  # its import runs again, outside the server
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL


def test_a_server_that_ends_under_a_running_driver_leaves_its_socket_to_the_driver():
    """The server removes its socket and the driver's multiprocessing folder only when the driver
    has gone (a killed driver: tests/integration/test_pool.py). A server that ends while its
    driver runs (here stopped by the driver, as multiprocessing's own tests stop it) leaves both:
    the driver removes the socket itself, and starts its next server in the same folder."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from multiprocessing import forkserver\n"
        "from tether.procinfo import start_child_server\n"
        "start_child_server()\n"
        "folder = os.path.dirname(forkserver._forkserver._forkserver_address)\n"
        "forkserver._forkserver._stop()\n"  # waits for the server, then unlinks the socket itself
        "assert os.path.isdir(folder)\n"
        "start_child_server()\n"
        "assert os.path.dirname(forkserver._forkserver._forkserver_address) == folder\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
