"""A local Ray instance whose temp dir sat under /tmp (the run directory's path too long for Ray's
sockets) leaves its logs in the run's `ray` folder and nothing under /tmp."""

import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from tether.rollout.backends.ray import reaper
from tether.rollout.backends.ray.reaper import bring_home


@pytest.fixture
def instance_dir():
    """What an ended instance leaves: a session folder with logs and a socket, and a link to it."""
    top = Path(tempfile.mkdtemp(prefix="tether-ray-test-", dir="/tmp"))  # short: a socket fits
    session = top / "session_2026-12-07_1"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("raylet started\n")
    (session / "sockets").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(session / "sockets" / "raylet"))
    (top / "session_latest").symlink_to(session)
    yield top
    sock.close()
    shutil.rmtree(top, ignore_errors=True)


def test_the_logs_replace_the_link_and_the_temp_dir_is_removed(instance_dir, tmp_path):
    home = tmp_path / "run" / "ray"
    home.parent.mkdir()
    home.symlink_to(instance_dir)
    assert bring_home(instance_dir, home)
    assert not instance_dir.exists()
    assert home.is_dir() and not home.is_symlink()
    assert (home / "session_2026-12-07_1" / "logs" / "raylet.out").read_text() == "raylet started\n"
    # sockets and links stay out: nothing in the run folder points back to /tmp
    assert list((home / "session_2026-12-07_1" / "sockets").iterdir()) == []
    assert not (home / "session_latest").exists() and not (home / "session_latest").is_symlink()
    assert not (tmp_path / "run" / "ray.partial").exists()


def test_an_earlier_attempts_sessions_stay_beside_the_new_one(instance_dir, tmp_path):
    home = tmp_path / "ray"
    (home / "session_2026-12-06_0" / "logs").mkdir(parents=True)
    (home / "session_2026-12-06_0" / "logs" / "raylet.out").write_text("earlier\n")
    assert bring_home(instance_dir, home)
    assert sorted(p.name for p in home.iterdir()) == ["session_2026-12-06_0", "session_2026-12-07_1"]
    assert (home / "session_2026-12-06_0" / "logs" / "raylet.out").read_text() == "earlier\n"


def test_a_failed_copy_removes_nothing_and_the_link_still_leads_to_the_logs(instance_dir, tmp_path,
                                                                             monkeypatch):
    home = tmp_path / "ray"
    home.symlink_to(instance_dir)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reaper.shutil, "copytree", full_disk)
    assert not bring_home(instance_dir, home)
    assert home.is_symlink() and (home / "session_2026-12-07_1" / "logs" / "raylet.out").is_file()
    assert not (tmp_path / "ray.partial").exists()


def test_a_temp_dir_already_gone_is_not_an_error(tmp_path):
    home = tmp_path / "ray"
    home.symlink_to(tmp_path / "gone")
    assert bring_home(tmp_path / "gone", home)
    assert home.is_symlink()  # nothing to bring; the dangling link is left as it was
