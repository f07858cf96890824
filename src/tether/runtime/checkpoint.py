"""Checkpoints at hard boundaries: atomic, verified, the last K kept.

Layout of ``RUN/checkpoints/step-000010/``: ``learner/`` (model safetensors and tokenizer,
optimizer, scheduler, RNG), ``state.json`` (the loop state: trained and launched batches, drops,
train and rollout versions, batches to generate again — the data cursor and the control state),
``published.safetensors`` when the engines held older weights than the learner's (a checkpoint
written on a stop between two publications: a resume loads them into the engines again so the
run continues exactly), and ``manifest.json`` (size and SHA-256 of every other file), written
last.

A checkpoint is built in a temporary folder, every file fsynced, then renamed into place, so a
crash mid-save leaves no ``step-*`` folder. On restore, a checkpoint whose manifest is missing or
whose files do not match it is refused with a message saying what is wrong, and the newest good
one is used instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from tether.errors import CheckpointError, ConfigError, LearnerLostError
from tether.filehash import sha256_of
from tether.vocabulary import LoopState

log = logging.getLogger("tether.checkpoint")
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
PUBLISHED = "published.safetensors"




def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _why(exc: BaseException) -> str:
    """A one-line cause for a failed write, naming the usual suspects."""
    import errno

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or "No space left" in text or "file write failed" in text:
        return f"the disk is full: {text}"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied: {text}"
    return f"{type(exc).__name__}: {text}"


class DamagedCheckpoint(ConfigError):
    """A checkpoint is incomplete or its files do not match its manifest."""


class Checkpointer:
    def __init__(self, root: Path, *, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:06d}"

    def save(self, step: int, state: LoopState, learner, *, published=None) -> Path:
        """Write checkpoint ``step`` atomically. ``published``: the engines' weights when they
        differ from the learner's. A failure (disk full, permissions) raises ``CheckpointError``
        and leaves nothing behind; earlier checkpoints are untouched."""
        final = self.path(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            learner.save(tmp / "learner")
            if published is not None:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in published.items()}, str(tmp / PUBLISHED),
                          metadata={"version": str(state.rollout_version)})
            (tmp / "state.json").write_text(json.dumps({"step": step, **asdict(state)}, indent=2) + "\n")
            files = sorted(p for p in tmp.rglob("*") if p.is_file())
            manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
                        for p in files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except LearnerLostError:  # not a write that failed: a rank died meanwhile, and says so
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            good = self.list()
            kept = (f"the last good checkpoint, {good[-1].name}, is kept" if good
                    else "no earlier checkpoint exists")
            raise CheckpointError(
                f"could not write checkpoint {final} ({_why(exc)}); nothing of it was left behind and "
                f"{kept}. Free space or fix the permissions of {self.root}, then resume") from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for old in self.list()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def list(self) -> list[Path]:
        """Checkpoint folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))

    def verify(self, path: Path) -> LoopState:
        """The loop state of a checkpoint whose files all match its manifest; else DamagedCheckpoint."""
        manifest_path = path / "manifest.json"
        if not manifest_path.is_file():
            raise DamagedCheckpoint(f"checkpoint {path} has no manifest.json (an interrupted save?)")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DamagedCheckpoint(f"checkpoint {path}: manifest.json is unreadable: {exc}") from exc
        entries = manifest.values() if isinstance(manifest, dict) else ()
        if (not isinstance(manifest, dict) or "state.json" not in manifest
                or not all(isinstance(e, dict) and {"bytes", "sha256"} <= e.keys() for e in entries)):
            raise DamagedCheckpoint(f"checkpoint {path}: manifest.json does not list the checkpoint's files "
                                    "with their sizes and checksums (damaged or hand-edited)")
        for rel, expected in manifest.items():
            f = path / rel
            if not f.is_file():
                raise DamagedCheckpoint(f"checkpoint {path} is missing {rel}")
            if f.stat().st_size != expected["bytes"]:
                raise DamagedCheckpoint(f"checkpoint {path}: {rel} has {f.stat().st_size} bytes, "
                                        f"expected {expected['bytes']} (truncated or overwritten)")
            if sha256_of(f) != expected["sha256"]:
                raise DamagedCheckpoint(f"checkpoint {path}: {rel} does not match its checksum (corrupted)")
        try:
            data = json.loads((path / "state.json").read_text())
            data.pop("step", None)
            data["pending"] = tuple(data.get("pending", ()))
            state = LoopState(**data)
        except (json.JSONDecodeError, TypeError, AttributeError) as exc:
            raise DamagedCheckpoint(f"checkpoint {path}: state.json is not a loop state: {exc}") from exc
        if state.rollout_version is not None and state.rollout_version != state.train_version \
                and PUBLISHED not in manifest:
            raise DamagedCheckpoint(f"checkpoint {path}: the engines held version {state.rollout_version} "
                                    f"but {PUBLISHED} is missing")
        return state

    def newest_good(self, *, doing: str = "resume") -> tuple[LoopState, Path]:
        """The newest checkpoint that passes its manifest check; damaged ones are refused by name
        (logged) and the previous good one is taken."""
        found = self.list()
        if not found:
            raise ConfigError(f"nothing to {doing}: {self.root} holds no checkpoint "
                              "(checkpoint.interval was 0, or the run stopped before its first save)")
        problems = []
        for path in reversed(found):
            try:
                state = self.verify(path)
            except DamagedCheckpoint as exc:
                log.error("refusing damaged checkpoint: %s", exc)
                problems.append(str(exc))
                continue
            if problems:
                log.warning("using the previous good checkpoint %s", path)
            return state, path
        raise DamagedCheckpoint("no usable checkpoint: " + "; ".join(problems))

def published_weights(path: Path):
    """The engines' weights a checkpoint kept (``published.safetensors``), or None."""
    f = Path(path) / PUBLISHED
    if not f.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(f))


def trim_jsonl(path: Path, max_step: int) -> None:
    """Drop lines logged after ``max_step`` (they are produced again after a resume)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= max_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
