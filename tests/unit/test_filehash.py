"""A large file's SHA-256 is computed once per version of the file: cached by its path and stamp
(size, modification and change times, inode), hashed again when the file is replaced, even by one
of the same size with its modification time put back."""

import hashlib
import json
import os
import time

from tether.filehash import CACHE_FILE, CACHED_FROM, hashes


def test_a_large_files_hash_is_cached_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE_DIR", str(tmp_path / "cache"))
    big, small = tmp_path / "model.safetensors", tmp_path / "config.json"
    big.write_bytes(b"\1" * CACHED_FROM)
    small.write_text("{}")
    assert hashes([big, small]) == {big: hashlib.sha256(big.read_bytes()).hexdigest(),
                                    small: hashlib.sha256(b"{}").hexdigest()}
    cache_file = tmp_path / "cache" / CACHE_FILE
    cache = json.loads(cache_file.read_text())
    assert list(cache) == [str(big.resolve())]  # small files are hashed each time
    # the cache is what is read while the stamp holds: a planted digest shows it was not re-hashed
    cache_file.write_text(json.dumps({str(big.resolve()): [*cache[str(big.resolve())][:-1], "planted"]}))
    assert hashes([big])[big] == "planted"
    # other contents of the same size, the modification time put back: hashed again
    stamp = big.stat()
    time.sleep(0.05)
    replaced = tmp_path / "other"
    replaced.write_bytes(b"\2" * CACHED_FROM)
    os.replace(replaced, big)
    os.utime(big, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert big.stat().st_size == stamp.st_size and big.stat().st_mtime_ns == stamp.st_mtime_ns
    assert hashes([big])[big] == hashlib.sha256(b"\2" * CACHED_FROM).hexdigest()
    with big.open("r+b") as f:  # rewritten in place: the same inode, a new change time
        time.sleep(0.05)
        f.write(b"\3")
    os.utime(big, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert hashes([big])[big] == hashlib.sha256(big.read_bytes()).hexdigest()


def test_a_cache_folder_others_can_write_in_is_not_used(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    monkeypatch.setenv("TETHER_CACHE_DIR", str(folder))
    big = tmp_path / "weights"
    big.write_bytes(b"\1" * CACHED_FROM)
    assert hashes([big])[big] == hashlib.sha256(big.read_bytes()).hexdigest()
    assert not (folder / CACHE_FILE).exists()
