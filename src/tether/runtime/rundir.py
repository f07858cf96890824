"""The run directory's guards: one process at a time, no leftovers, and a resume that cannot
silently change what the run is.

- ``RunLock``: an exclusive ``flock`` on ``RUN/.lock`` held for the run's life. The OS releases it
  when the process ends, however it ends, so a crashed run never leaves a stale lock; a second
  process is refused with the holder's pid, host, start time and command.
- ``clean_leftovers``: the temporary folders of saves that were interrupted (``.tmp-step-*``), and
  the temporary files of an interrupted trim of the metrics on resume, are removed once the lock
  is held (nobody else can be writing them).
- ``starts.jsonl``: one line per start (new or resumed) with the command line, the overrides,
  the checkpoint resumed from and the data fingerprint; ``config.yaml`` is rewritten on resume
  so it always holds the config the run continues with.
- ``never_trained`` / ``reuse_untrained``: a directory whose start failed or was stopped before its
  first batch (no metrics row, no checkpoint) is no run to resume; a new start in it reuses it,
  under the lock, keeping ``starts.jsonl`` and Ray's logs.
- ``resume_changes``: the keys a resume changes, sorted into those that are safe and those that
  would change the prompt stream or the schedule already trained (refused without ``--force``), as
  each key's definition declares (``knob(resume=...)``, gathered by ``tether.config.keys``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.config.keys import default_of, resume_of, table
from tether.errors import ConfigError, RunBusyError

log = logging.getLogger("tether.run")

LOCK_NAME = ".lock"
STARTS_NAME = "starts.jsonl"


class RunLock:
    """An exclusive lock on a run directory for as long as this object is held open."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunBusyError(
                f"run directory {self.run_dir} is in use by another process ({holder}); wait for it "
                "to finish or stop it first (Ctrl-C, or `kill -TERM PID` saves a final checkpoint), "
                "or choose another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "command": " ".join(sys.argv)}).encode() + b"\n")
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        if info:
            return (f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}: "
                    f"{info.get('command')}")
    return "holder unknown"


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove what interrupted saves left behind (``checkpoints/.tmp-step-*``); call with the lock
    held. Returns what was removed."""
    removed = []
    ckpts = Path(run_dir) / "checkpoints"
    if ckpts.is_dir():
        for tmp in sorted(ckpts.glob(".tmp-*")):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    for tmp in sorted(Path(run_dir).glob("*.tmp")):  # trim_jsonl's (metrics.tmp, eval.tmp)
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    if removed:
        log.info("removed %d leftover(s) of an interrupted save: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


# What a start of a run writes in its directory (besides a family's records, NAME.jsonl): a
# directory holding only these, with no metrics row and no checkpoint, never trained a batch.
RUN_FILES = frozenset({LOCK_NAME, STARTS_NAME, "config.yaml", "summary.json", "checkpoints", "tensorboard",
                       "plots", "samples", "ray"})
KEPT_ON_REUSE = frozenset({LOCK_NAME, STARTS_NAME, "ray"})  # the starts' record; Ray's logs, by session


def never_trained(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a run directory whose start failed or was stopped before its first
    batch trained: it holds a record of its start, no metrics row, no checkpoint, and nothing a
    run does not write (a directory with other files is someone's, not to be reused)."""
    run_dir = Path(run_dir)
    if not (run_dir / STARTS_NAME).is_file():
        return False
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.read_text().strip():
        return False
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir()):
        return False
    return all(p.name in RUN_FILES or p.suffix in (".jsonl", ".tmp") for p in run_dir.iterdir())


def where_to_resume(run_dir: Path) -> str:
    """What a stopped run leaves: the command that continues it, if a checkpoint exists (told by
    ``tether train`` after a stop or an error, and after Ray ended its process without a word)."""
    from tether.runtime.checkpoint import Checkpointer

    if Checkpointer(run_dir / "checkpoints").list():
        return f"the run directory is {run_dir} (resume with `tether train --resume {run_dir}`)"
    if run_dir.is_dir() and never_trained(run_dir):
        return (f"the run directory is {run_dir}; it trained no batch, so there is nothing to resume: start "
                f"the run again with --run-dir {run_dir} to reuse it")
    if run_dir.is_dir():
        return (f"the run directory is {run_dir}; it holds no checkpoint to resume from "
                "(checkpoint.interval=0, or it stopped before the first)")
    return "nothing was written"


def reuse_untrained(run_dir: Path) -> list[str]:
    """Clear a directory that ``never_trained`` for a new start in it; call with the lock held.
    Its ``starts.jsonl`` is kept (the new start is appended) and so are Ray's logs; what else the
    earlier start wrote (its config, events, an evaluation at step 0, …) is removed. Returns the
    names removed."""
    removed = []
    for path in sorted(Path(run_dir).iterdir()):
        if path.name in KEPT_ON_REUSE:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    log.info("reusing run directory %s: its earlier start trained no batch and left no checkpoint; "
             "starting afresh in it (removed %s; kept %s)", run_dir, ", ".join(removed) or "nothing",
             ", ".join(sorted(n for n in KEPT_ON_REUSE - {LOCK_NAME} if (Path(run_dir) / n).exists())))
    return removed


def data_fingerprint(examples: Iterable[Any]) -> str:
    """SHA-256 over the prompts, answers and fields of ``examples`` in order: any change to the
    dataset file, its loader or the task's generator changes it."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.prompt, ex.answer, dict(ex.fields)], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def record_start(run_dir: Path, *, overrides: list[str], resumed_from: str | None, fingerprint: str,
                 forced: list[str] | None = None) -> None:
    entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid(), "command": sys.argv,
             "overrides": overrides, "resumed_from": resumed_from, "data_fingerprint": fingerprint}
    if forced:
        entry["forced_changes"] = forced
    with (Path(run_dir) / STARTS_NAME).open("a") as f:
        f.write(json.dumps(entry) + "\n")


def first_fingerprint(run_dir: Path) -> str | None:
    """The data fingerprint the run was started with: its latest new start's (an earlier one
    trained nothing: its directory was reused); None for runs made before it was kept."""
    path = Path(run_dir) / STARTS_NAME
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            entry = json.loads(line)
            if entry.get("resumed_from") is None:
                found = entry.get("data_fingerprint")
    return found


@dataclass(frozen=True)
class ResumeChanges:
    safe: list[str]
    refused: list[tuple[str, str]]  # (change, why)


def _flatten(d: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, keys in d.items() for key, value in keys.items()}


def resume_changes(old: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]
                   ) -> ResumeChanges:
    """Sort the keys that differ between the run's config and the resumed one, each by what its
    definition declares a resume does with it (``tether.config.keys``)."""
    keys = table()
    a, b = _flatten(old), _flatten(new)
    safe, refused = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        if (key in a) != (key in b) and (a if key in a else b)[key] == default_of(key):
            continue  # a section one config records and the other leaves out (an engine's or
            # backend's not chosen), at its default: nothing changes
        change = f"{key}: {a.get(key)!r} → {b.get(key)!r}"
        resume = resume_of(key, keys)
        if resume.refused:
            refused.append((change, resume.why))
        else:
            safe.append(change)
    return ResumeChanges(safe, refused)


def check_resume(run_dir: Path, old: Mapping, new: Mapping, fingerprint: str, *, force: bool) -> list[str]:
    """Refuse (ConfigError) a resume that would change the run, unless ``force``; returns the
    forced changes to record. Safe changes are logged."""
    changes = resume_changes(old, new)
    for change in changes.safe:
        log.info("resume changes %s", change)
    problems = [f"{change} ({why})" for change, why in changes.refused]
    recorded = first_fingerprint(run_dir)
    if recorded is not None and recorded != fingerprint:
        problems.append(f"the training data differ from the data the run started with (fingerprint "
                        f"{recorded[:12]} → {fingerprint[:12]}: a dataset file was replaced or edited, "
                        "or the task generator changed), which changes the prompt stream")
    if problems and not force:
        raise ConfigError(
            f"resuming {run_dir} would change the run:\n  - " + "\n  - ".join(problems)
            + "\nUndo these changes, start a new run from the checkpoint's model "
            "(model.path=RUN/checkpoints/step-N/learner/model), or pass --force to resume anyway "
            "(the changes are recorded in starts.jsonl)"
        )
    for problem in problems:
        log.warning("resume --force: %s", problem)
    return problems
