"""The native decode step (``decode_step.c``): built here, on first use, with the machine's C compiler.

``FastDecoder.decode`` runs a whole decode step through it on the CPU in float32 (one call in
place of ~300 framework operations; docs/benchmarks.md has the measurements). It multiplies
through torch's own ``sgemm_`` (MKL in the CPU wheels), so it needs nothing torch does not
already bring but a C compiler.

The shared library is compiled once per source, flags, compiler and CPU into a cache folder
(``$TETHER_CACHE_DIR``, else ``$XDG_CACHE_HOME/tether``, else ``~/.cache/tether``), with
``-march=native``: keyed by the CPU's feature flags, so a home folder shared between machines of
different kinds builds one library per kind. Concurrent first uses (a pool's workers) each build
into a private file and move it in place atomically.

``TETHER_NATIVE_DECODE`` chooses: ``auto`` (the default) uses it when it builds and loads, else
the Python path, saying why once in the log; ``1`` requires it (an error says why it cannot
run); ``0`` never uses it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.c")
# -fassociative-math lets the compiler vectorise the loops' sums (it needs the two after it);
# finite-math is left off on purpose: masked keys are -inf
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC")
ENV = "TETHER_NATIVE_DECODE"

# the order of decode_step.c's enums
CONFIG = ("batch", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "layers", "capacity",
          "qk_norm", "qkv_bias", "o_bias", "gelu", "embed_rows")
ROOT = ("embed", "norm", "head_t", "rotary", "key_bias", "scratch")
PER_LAYER = ("ln1", "ln2", "qkv_t", "qkv_bias", "qk_norm", "o_t", "o_bias", "gate_up_t", "down_t",
             "k_cache", "v_cache")


class NativeUnavailable(RuntimeError):
    """The native decode step cannot run here; the message says why and what to change."""


def mode() -> str:
    """``auto``, ``on`` or ``off``, from ``TETHER_NATIVE_DECODE``."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    for name, spellings in (("auto", ("auto", "")), ("on", ("1", "on", "true", "yes")),
                            ("off", ("0", "off", "false", "no"))):
        if raw in spellings:
            return name
    raise ValueError(f"{ENV}={raw!r}: use auto, 1 (require the native decode step) or 0 (never use it)")


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


def build() -> Path:
    """The compiled library's path, building it if this source, compiler and CPU have none yet."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the C compiler {cc} does not run: {e}") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"decode_step-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _sgemm_address() -> int:
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        handle = ctypes.CDLL(str(lib))
        return ctypes.cast(handle.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"this torch ({lib}) exports no sgemm_ to multiply with: {e}") from e


def _open() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    lib.tether_set_sgemm.argtypes = [ctypes.c_void_p]
    lib.tether_set_sgemm(_sgemm_address())
    lib.tether_scratch_floats.argtypes = [ctypes.c_void_p]
    lib.tether_scratch_floats.restype = ctypes.c_int64
    lib.tether_decode_step.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.tether_decode_step.restype = ctypes.c_int
    return lib


@cache
def _attempt() -> ctypes.CDLL | Exception:
    """The library, or why it cannot be had: tried once per process, a failed build included."""
    try:
        return _open()
    except (NativeUnavailable, OSError) as e:
        return e


_said: set[str] = set()


def library() -> ctypes.CDLL | None:
    """The loaded library, or None when ``TETHER_NATIVE_DECODE`` is off or (``auto``) it cannot be
    built or loaded here — said once in the log, with the reason. With ``1`` that is an error."""
    chosen = mode()
    if chosen == "off":
        return None
    got = _attempt()
    if not isinstance(got, Exception):
        return got
    if chosen == "on":
        raise NativeUnavailable(f"{ENV}=1 but the native decode step cannot run: {got}") from got
    if str(got) not in _said:
        _said.add(str(got))
        log.warning("native decode step unavailable, decoding with the Python path: %s "
                    "(set %s=0 to skip trying)", got, ENV)
    return None


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class NativeStep:
    """One batch's decode steps through the library: the configuration and pointer table of a
    ``FastDecoder`` after its prefill, and the step's scratch buffer. Valid until the decoder's
    next prefill or weight re-read (it holds no references the decoder does not)."""

    def __init__(self, lib: ctypes.CDLL, dec) -> None:
        layers = dec.layers
        self.lib, self.dec = lib, dec
        self.vocab = dec.head_t.shape[1]
        values = dict(batch=dec.batch, hidden=dec.embed.shape[1], heads=dec.heads, kv_heads=dec.kv_heads,
                      head_dim=dec.head_dim, inter=layers[0].down_t.shape[0], vocab=self.vocab,
                      layers=len(layers), capacity=dec.capacity, qk_norm=int(layers[0].qk_norm is not None),
                      qkv_bias=int(layers[0].qkv_bias is not None), o_bias=int(layers[0].o_bias is not None),
                      gelu=int(dec.act is torch.nn.functional.gelu), embed_rows=dec.embed.shape[0])
        self.cfg = torch.tensor([values[k] for k in CONFIG], dtype=torch.int64)
        self.scratch = torch.empty(lib.tether_scratch_floats(self.cfg.data_ptr()), dtype=torch.float32)
        root = dict(embed=dec.embed, norm=dec.norm, head_t=dec.head_t, rotary=dec.rotary,
                    key_bias=dec.key_bias, scratch=self.scratch)
        table = [_pointer(root[k]) for k in ROOT]
        for i, layer in enumerate(layers):
            parts = dict(vars(layer), k_cache=dec.k_cache[i], v_cache=dec.v_cache[i])
            table += [_pointer(parts[k]) for k in PER_LAYER]
        self.table = (ctypes.c_void_p * len(table))(*table)
        self.eps, self.scale = float(dec.eps), float(dec.scale)

    @staticmethod
    def unusable(dec) -> str | None:
        """Why this decoder's state cannot go through the native step (None: it can)."""
        tensors = [dec.embed, dec.norm, dec.head_t, dec.rotary, dec.key_bias, *dec.k_cache, *dec.v_cache]
        for layer in dec.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        if any(t.device.type != "cpu" for t in tensors):
            return "the model is not on the CPU"
        if any(t.dtype != torch.float32 for t in tensors):
            return "the model is not float32"
        if not all(t.is_contiguous() for t in tensors):
            return "a weight is not contiguous"
        kinds = {(x.qk_norm is None, x.qkv_bias is None, x.o_bias is None) for x in dec.layers}
        if len(kinds) > 1:
            return "the layers differ in their norms or biases"
        return None

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (B,) at the decoder's current length; the next logits, (B, V)."""
        dec = self.dec
        if tokens.shape != (dec.batch,):
            raise ValueError(f"decode takes one token per row, ({dec.batch},); got {tuple(tokens.shape)}")
        tokens = tokens.to(torch.int64).contiguous()
        logits = torch.empty(dec.batch, self.vocab, dtype=torch.float32)
        status = self.lib.tether_decode_step(self.cfg.data_ptr(), self.eps, self.scale, self.table,
                                             dec.length, tokens.data_ptr(), dec.next_pos.data_ptr(),
                                             logits.data_ptr())
        if status != 0:
            row = -1 - status
            raise IndexError(f"token {int(tokens[row])} of row {row} is outside the embedding table "
                             f"(0..{dec.embed.shape[0] - 1})")
        return logits
