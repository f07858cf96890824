"""Building the native library: the compiler, its flags, the private cache folder and the build
lock (the module docstring of ``tether.decoding.native`` says what each guards against).

``build()`` returns the compiled library's path, compiling it first when this source, these flags,
this compiler and this CPU have none yet; ``tether.decoding.native`` loads what it returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("decode_step.c")
# -fassociative-math lets the compiler vectorise the loops' sums (it needs the two after it);
# finite-math is left off on purpose: masked keys are -inf
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC")
if platform.machine() in ("x86_64", "AMD64"):
    # gcc and clang keep loops to 256-bit vectors by default; the loops here are short and
    # memory-light, so AVX-512 machines run them faster at full width (-march=native decides
    # whether there is one)
    FLAGS += ("-mprefer-vector-width=512",)
# time the library's sections (benchmarks/engine.py --profile); a build of its own
PROFILE_ENV = "TETHER_NATIVE_PROFILE"

BUILD_TIMEOUT_S = 120.0


class NativeUnavailable(Exception):
    """Why the library cannot be had (raised while building or loading it; ``native.library`` turns
    it into a warning under ``auto`` and a ``NativeDecoderError`` under ``native``)."""


def cache_dir() -> Path:
    if os.environ.get("TETHER_CACHE_DIR"):
        return Path(os.environ["TETHER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tether"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise NativeUnavailable("no C compiler found (install gcc, or set CC)")
    return cc


def _flags() -> tuple[str, ...]:
    return (*FLAGS, "-DTETHER_PROFILE") if os.environ.get(PROFILE_ENV) == "1" else FLAGS


def _source_key() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]


def _private_folder(folder: Path) -> Path:
    """``folder``, made 0700 if new; refused unless this user owns it and no one else can write in
    it (a library planted there would run in every rollout worker)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise NativeUnavailable(f"cannot make the native decoder's cache folder {folder}: {e}") from e
    _trusted(folder, "cache folder")
    return folder


def _trusted(path: Path, what: str) -> None:
    st = path.stat()
    fix = "set TETHER_CACHE_DIR to a folder of your own (rollout.decoder=python skips the library)"
    if st.st_uid != os.getuid():
        raise NativeUnavailable(f"the native decoder's {what} {path} belongs to another user (uid "
                                f"{st.st_uid}), and a library from there would run in this process; {fix}")
    if st.st_mode & 0o022:
        raise NativeUnavailable(f"the native decoder's {what} {path} can be written by others (mode "
                                f"{oct(st.st_mode & 0o777)}), so a library from there could be anyone's; "
                                f"chmod go-w it, or {fix}")


@contextlib.contextmanager
def _build_lock(folder: Path):
    """Held by the one process building; the others wait, then find the library built."""
    import fcntl

    fd = os.open(folder / ".build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def build() -> Path:
    """The compiled library's path, building it if this source, compiler and CPU have none yet."""
    cc, flags = _compiler(), _flags()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the C compiler {cc} does not run: {e}") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, version, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    folder = _private_folder(cache_dir() / "native")
    target = folder / f"decode_step-{_source_key()}-{key}.so"
    with _build_lock(folder):
        if not target.exists():
            _compile(cc, flags, target)
            _remove_stale(folder)
    _trusted(target, "library")
    return target


def _compile(cc: str, flags: tuple[str, ...], target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        # its own process group: a compiler stopped at the time limit takes its children with it
        proc = subprocess.Popen([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise NativeUnavailable(f"{cc} took more than {BUILD_TIMEOUT_S:.0f}s to build {SOURCE.name}, "
                                    "and was stopped") from None
        if proc.returncode != 0:
            raise NativeUnavailable(f"{cc} failed to build {SOURCE.name}: {err.strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _remove_stale(folder: Path) -> None:
    """Libraries built from another version of the source, and partial builds of a process gone."""
    for old in folder.glob("decode_step-*.so"):
        if not old.name.startswith(f"decode_step-{_source_key()}-"):
            with contextlib.suppress(OSError):
                old.unlink()
