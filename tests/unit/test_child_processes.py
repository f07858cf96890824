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
