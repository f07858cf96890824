"""SHA-256 of a file's contents, computed once per version of the file.

A LoRA checkpoint names the base model its adapters were trained on by a fingerprint of the
base's contents (``tether.modeling.fingerprint``), checked at every resume, ``tether eval`` and
``tether export``: a base of 15 GB takes about a minute to hash, so each large file's hash is kept
in ``file-hashes.json`` in Tether's cache folder (``$TETHER_CACHE_DIR``, else
``$XDG_CACHE_HOME/tether``, else ``~/.cache/tether``), keyed by the file's absolute path and
its stamp: size, modification time, change time and inode. Rewriting a file, or replacing it by
another (``cp``, ``mv``, a download), changes its change time or inode even where the size and
modification time are made to match, so its contents are hashed again.

The cache is only a shortcut: when its folder cannot be made, belongs to another user or can be
written by others, or the file cannot be read, every file is hashed afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("tether.filehash")
CACHED_FROM = 1 << 20
"""Files of at least this many bytes have their hash cached; smaller ones are hashed each time."""
CACHE_FILE = "file-hashes.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _cache_folder() -> Path | None:
    """Tether's cache folder when it is this user's own and no one else can write in it."""
    from tether.decoding.native.builder import cache_dir

    folder = cache_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None
    return folder


def _read(file: Path) -> dict[str, list]:
    try:
        cache = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write(file: Path, cache: dict[str, list]) -> None:
    """Atomically, dropping the entries of files that are gone."""
    kept = {path: entry for path, entry in cache.items() if os.path.exists(path)}
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(kept) + "\n")
        os.replace(tmp, file)
    except OSError as exc:
        log.debug("cannot write the file-hash cache %s: %s", file, exc)
        tmp.unlink(missing_ok=True)


def hashes(paths: Iterable[Path]) -> dict[Path, str]:
    """path → SHA-256 hex digest of each file's contents; large files' from the cache when their
    stamp has not changed since they were hashed."""
    folder = _cache_folder()
    file = folder / CACHE_FILE if folder else None
    cache = _read(file) if file else {}
    out, changed = {}, False
    for path in paths:
        key = str(Path(path).resolve())
        st = Path(path).stat()
        entry = cache.get(key)
        if st.st_size >= CACHED_FROM and isinstance(entry, list) and entry[:-1] == _stamp(st):
            out[path] = entry[-1]
            continue
        if st.st_size >= 1 << 30:
            log.info("hashing %s (%.1f GB) once: the base model's fingerprint", path, st.st_size / 1e9)
        out[path] = sha256_of(Path(path))
        if st.st_size >= CACHED_FROM and file is not None:
            cache[key], changed = [*_stamp(st), out[path]], True
    if changed:
        _write(file, cache)
    return out
