"""The native decoder (``decode_step.c``): built here, on first use, with the machine's C compiler.

``FastDecoder`` runs a batch's prefill and each of its decode steps through it on the CPU in
float32, one call each (in place of ~300 framework operations a step; docs/benchmarks.md has the
measurements, docs/rollout.md the design). It multiplies with MKL's packed GEMMs from torch's own
library (the CPU wheels link MKL in), so it needs nothing torch does not already bring but a C
compiler. ``NativeModel`` holds a model's packed weights, ``NativeBatch`` one batch's state.

The shared library is compiled once per source, flags, compiler and CPU into a cache folder
(``$TETHER_CACHE_DIR``, else ``$XDG_CACHE_HOME/tether``, else ``~/.cache/tether``), with
``-march=native``: keyed by the CPU's feature flags, so a home folder shared between machines of
different kinds builds one library per kind. The library runs in this process, so its folder is
made private (0700) and both are refused unless this user owns them and no one else can write
them. Concurrent first uses (a pool's workers) wait on a lock while one of them builds, into a
private file moved in place atomically; a compiler that takes longer than ``BUILD_TIMEOUT_S`` is
stopped, its process group with it. Builds of another version of the source are removed. A file
at the library's name that does not load, lacks the library's symbols or speaks another interface
is built afresh once.

The same library holds ``tether_copy_checksum``, the weight channel's copy of a tensor into the
shared block that sums its words in the same pass (``helpers``; ``tether.rollout.channel``).

``rollout.decoder`` (``FastDecoder(decoder=...)``) chooses: ``auto`` (the default) uses it
when it builds and loads and the model is float32 on the CPU, else the Python path, saying once
in the log why the library could not be had; ``native`` requires it (an error says why it
cannot run); ``python`` never uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess
from functools import cache
from pathlib import Path

import torch

from tether.decoding.linear import bias_of, weight_of
from tether.decoding.native.builder import NativeUnavailable, build
from tether.errors import ConfigError, NativeDecoderError

log = logging.getLogger(__name__)

SECTIONS = ("norms", "qkv GEMM", "q/k norm, rotary, KV write", "attention", "o GEMM", "gate/up GEMM",
            "activation", "down GEMM", "head GEMM", "sampling")

INTERFACE = 3
"""decode_step.c's INTERFACE_VERSION: the library's calls and tables as this module uses them."""
TOO_MANY_ROWS = -(2 ** 31)
"""decode_step.c's ST_TOO_MANY_ROWS status."""

# the order of decode_step.c's enums
CONFIG = ("batch", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "layers", "capacity",
          "qk_norm", "qkv_bias", "o_bias", "gelu", "embed_rows", "rows")
ROOT = ("embed", "norm", "head", "rotary", "key_bias", "scratch", "index")
PER_LAYER = ("ln1", "ln2", "qkv", "qkv_bias", "qk_norm", "o", "o_bias", "gate_up", "down", "kv_cache")


MODES = ("auto", "native", "python")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"decoder {mode!r}: use auto, native or python (rollout.decoder)")
    return mode


BLAS = ("cblas_sgemm_pack_get_size", "cblas_sgemm_pack", "cblas_sgemm_compute", "sgemm_")


def _blas_addresses() -> list[int]:
    """MKL's packed-GEMM entry points in torch's own library (the CPU wheels link MKL in)."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        handle = ctypes.CDLL(str(lib))
        return [ctypes.cast(getattr(handle, name), ctypes.c_void_p).value for name in BLAS]
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"this torch ({lib}) exports no MKL packed GEMM ({', '.join(BLAS)}): "
                                f"{e}") from e


def _open() -> ctypes.CDLL:
    """The library, built if need be; a file at its name that is no good (it does not load, lacks
    the library's symbols, or speaks another interface: truncated, planted, or of another
    Tether) is built afresh, once."""
    path = build()
    try:
        return _load(path)
    except NativeUnavailable as e:
        log.warning("the native decoder at %s is no good (%s); building it again", path, e)
        with contextlib.suppress(OSError):
            path.unlink()
        path = build()
        # loaded under a name of its own: the dynamic loader would hand back what it loaded from
        # the old file at this name
        alias = path.with_name(f"{path.stem}-{os.getpid()}.so")
        os.link(path, alias)
        try:
            return _load(alias)
        finally:
            alias.unlink()


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"{path} is not the native decoder: {e}") from e
    expected = (INTERFACE, len(CONFIG), len(ROOT), len(PER_LAYER), len(SECTIONS))
    found = tuple(lib.tether_interface(i) for i in range(len(expected)))
    if found != expected:
        raise NativeUnavailable(f"{path} speaks another interface (version and table sizes {found}, "
                                f"this Tether's {expected})")
    lib.tether_set_blas(*_blas_addresses())
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """Every call's argument and return types (an AttributeError names a missing one)."""
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.tether_interface.argtypes = [ctypes.c_int]
    lib.tether_interface.restype = i64
    lib.tether_set_blas.argtypes = [p, p, p, p]
    lib.tether_packed_floats.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.tether_packed_floats.restype = i64
    lib.tether_pack.argtypes = [p, ctypes.c_int, ctypes.c_int, p]
    lib.tether_pack.restype = None
    lib.tether_pack_stacked.argtypes = [p, ctypes.c_int, p, ctypes.c_int, p, ctypes.c_int, ctypes.c_int, p, p]
    lib.tether_pack_stacked.restype = None
    lib.tether_scratch_floats.argtypes = [p]
    lib.tether_scratch_floats.restype = i64
    lib.tether_index_ints.argtypes = [p]
    lib.tether_index_ints.restype = i64
    lib.tether_prefill.argtypes = [p, f32, f32, p, p, p, i64, i64, i64, p]
    lib.tether_prefill.restype = ctypes.c_int
    lib.tether_decode_step.argtypes = [p, f32, f32, p, i64, p, p, p]
    lib.tether_decode_step.restype = ctypes.c_int
    lib.tether_decode_run.argtypes = [p, f32, f32, p, i64, i64, p, p, i64, i64, p, p, f32, p, p, i64, p, p, p]
    lib.tether_decode_run.restype = i64
    lib.tether_copy_checksum.argtypes = [p, p, i64]
    lib.tether_copy_checksum.restype = i64


@cache
def _attempt() -> ctypes.CDLL | Exception:
    """The library, or why it cannot be had: tried once per process, a failed build included."""
    try:
        return _open()
    except (NativeUnavailable, OSError, subprocess.SubprocessError) as e:
        return e


_said: set[str] = set()


def library(mode: str = "auto") -> ctypes.CDLL | None:
    """The loaded library, or None: with ``python``; with ``auto`` when it cannot be built or
    loaded here (said once in the log, with the reason). With ``native`` that is an error saying
    why."""
    if check_mode(mode) == "python":
        return None
    got = _attempt()
    if not isinstance(got, Exception):
        return got
    if mode == "native":
        raise NativeDecoderError(f"rollout.decoder=native but the native decoder cannot run here: "
                                 f"{got}; rollout.decoder=auto or python decode without it") from got
    if str(got) not in _said:
        _said.add(str(got))
        log.warning("native decode step unavailable, decoding with the Python path: %s "
                    "(rollout.decoder=python skips trying)", got)
    return None


def helpers() -> ctypes.CDLL | None:
    """The library for what other modules call in it beside the decoder (the weight channel's
    one-pass copy and checksum), or None when it cannot be had here. Nothing is said either way:
    each caller has a plain path that gives the same bytes."""
    got = _attempt()
    return None if isinstance(got, Exception) else got


def profile(reset: bool = False) -> dict[str, float] | None:
    """Seconds spent in each section of the native forward since the last reset, when the
    library was built with ``TETHER_NATIVE_PROFILE=1``; else None."""
    lib = library()
    try:
        times = (ctypes.c_double * len(SECTIONS)).in_dll(lib, "tether_profile")
    except (ValueError, AttributeError, TypeError):
        return None
    out = dict(zip(SECTIONS, times, strict=True))
    if reset:
        ctypes.memset(times, 0, ctypes.sizeof(times))
    return out


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def unusable(model: torch.nn.Module) -> str | None:
    """Why this (lean-decoder-supported) model cannot run natively; None when it can."""
    params = list(model.parameters())
    if any(t.device.type != "cpu" for t in params):
        return "the model is not on the CPU"
    if any(t.dtype != torch.float32 for t in params):
        return "the model is not float32"
    attn = [layer.self_attn for layer in model.model.layers]
    if len({(hasattr(a, "q_norm"), a.q_proj.bias is None, a.o_proj.bias is None) for a in attn}) > 1:
        return "the layers differ in their norms or biases"
    return None


class NativeModel:
    """A model's weights as the library reads them: every weight matrix packed for MKL (q/k/v
    stacked, gate/up stacked, the head) into one buffer made once, the rest (embeddings, norms,
    biases) the model's own tensors. ``pack`` reads the model's current weights again, in place
    (``FastDecoder`` calls it after every weight change): about the cost of one copy of the
    weights, with no allocation, so no page is faulted in again. The buffer's size is what MKL
    asks for (~8 MB a matrix above its data, never touched: address space, not memory)."""

    def __init__(self, lib: ctypes.CDLL, dec) -> None:
        self.lib, self.heads, self.kv_heads = lib, dec.heads, dec.kv_heads
        inner = dec.model.model
        # (out, in) of each packed matrix: per layer q/k/v stacked, o, gate/up stacked, down; the head
        self.shapes = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.shapes += [(a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features,
                             a.q_proj.in_features), tuple(a.o_proj.weight.shape),
                            (2 * m.gate_proj.out_features, m.gate_proj.in_features),
                            tuple(m.down_proj.weight.shape)]
        self.shapes.append(tuple(dec.model.lm_head.weight.shape))
        # each packed matrix at a 64-byte boundary of one buffer
        sizes = [-(-lib.tether_packed_floats(n, k) // 16) * 16 for n, k in self.shapes]
        self.arena = torch.empty(sum(sizes), dtype=torch.float32)
        self.packed = list(self.arena.split(sizes))
        self.packed_ptrs = [t.data_ptr() for t in self.packed]
        # q/k/v and gate/up are stacked into this one buffer before packing
        self.staging = torch.empty(max(n * k for n, k in self.shapes[:-1]), dtype=torch.float32)
        self.staging_ptr = self.staging.data_ptr()
        self.vocab, self.inter = self.shapes[-1][0], inner.layers[0].mlp.down_proj.in_features
        self.pack(dec.model)

    def _pack(self, i: int, parts: list[torch.Tensor]) -> torch.Tensor:
        """Pack the row-stacked ``parts`` (each (rows, in), contiguous) as matrix ``i``."""
        n, k = self.shapes[i]
        if any(not t.is_contiguous() for t in parts):
            parts = [t.contiguous() for t in parts]
        if len(parts) == 1:
            self.lib.tether_pack(parts[0].data_ptr(), n, k, self.packed_ptrs[i])
        else:  # stacked in C, into the staging buffer
            a, b, c = (*parts, None)[:3]
            self.lib.tether_pack_stacked(a.data_ptr(), a.shape[0], b.data_ptr(), b.shape[0],
                                         c.data_ptr() if c is not None else None,
                                         c.shape[0] if c is not None else 0, k, self.staging_ptr,
                                         self.packed_ptrs[i])
        return self.packed[i]

    @torch.inference_mode()
    def pack(self, model: torch.nn.Module) -> None:
        """Read ``model``'s weights now."""
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach().contiguous()
        self.norm = inner.norm.weight.detach().contiguous()
        self.layers = []
        for i, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            biases = [bias_of(a.q_proj), bias_of(a.k_proj), bias_of(a.v_proj)]
            qk_norm = None
            if hasattr(a, "q_norm"):  # (H + KV, D)
                qk_norm = torch.cat([a.q_norm.weight.expand(self.heads, -1),
                                     a.k_norm.weight.expand(self.kv_heads, -1)])
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight.detach().contiguous(),
                ln2=layer.post_attention_layernorm.weight.detach().contiguous(),
                qkv=self._pack(4 * i, [weight_of(a.q_proj), weight_of(a.k_proj), weight_of(a.v_proj)]),
                qkv_bias=torch.cat(biases) if biases[0] is not None else None,
                qk_norm=qk_norm,
                o=self._pack(4 * i + 1, [weight_of(a.o_proj)]),
                o_bias=bias_of(a.o_proj).detach().contiguous() if bias_of(a.o_proj) is not None else None,
                gate_up=self._pack(4 * i + 2, [weight_of(m.gate_proj), weight_of(m.up_proj)]),
                down=self._pack(4 * i + 3, [weight_of(m.down_proj)])))
        self.head = self._pack(len(self.shapes) - 1, [weight_of(model.lm_head)])


class NativeBatch:
    """One batch through the library: its configuration, pointer table and scratch, made at the
    decoder's prefill (after its KV cache, key mask and rotary table), for the prefill and every
    decode step of that batch. Holds the weights of one ``NativeModel``; a weight change
    mid-generation makes a new one over the same cache (``rebind``)."""

    def __init__(self, weights: NativeModel, dec, rows: int) -> None:
        # reads the decoder's batch state and keeps the tensors, not the decoder (no cycle)
        self.lib, self.batch = weights.lib, dec.batch
        values = dict(batch=dec.batch, hidden=weights.embed.shape[1], heads=dec.heads, kv_heads=dec.kv_heads,
                      head_dim=dec.head_dim, inter=weights.inter, vocab=weights.vocab,
                      layers=len(weights.layers), capacity=dec.capacity,
                      qk_norm=int(weights.layers[0]["qk_norm"] is not None),
                      qkv_bias=int(weights.layers[0]["qkv_bias"] is not None),
                      o_bias=int(weights.layers[0]["o_bias"] is not None),
                      gelu=int(dec.act is torch.nn.functional.gelu), embed_rows=weights.embed.shape[0],
                      rows=max(rows, dec.batch))
        self.cfg = torch.tensor([values[k] for k in CONFIG], dtype=torch.int64)
        self.scratch = dec.buffer("native scratch", (self.lib.tether_scratch_floats(self.cfg.data_ptr()),),
                                  torch.float32)
        self.index = dec.buffer("native index", (self.lib.tether_index_ints(self.cfg.data_ptr()),),
                                torch.int64)
        self.eps, self.scale = float(dec.eps), float(dec.scale)
        self._logits = torch.empty(dec.batch, weights.vocab, dtype=torch.float32)  # run's
        self._logits_ptr, self._cfg = self._logits.data_ptr(), self.cfg.data_ptr()
        self.state = dict(rotary=dec.rotary, key_bias=dec.key_bias, kv_cache=dec.kv_cache)
        self.rebind(weights)

    def rebind(self, weights: NativeModel) -> None:
        """Read ``weights`` from the next call on (the cache stays)."""
        self.weights, state = weights, self.state
        root = dict(embed=weights.embed, norm=weights.norm, head=weights.head, rotary=state["rotary"],
                    key_bias=state["key_bias"], scratch=self.scratch, index=self.index)
        table = [_pointer(root[k]) for k in ROOT]
        for i, layer in enumerate(weights.layers):
            parts = dict(layer, kv_cache=state["kv_cache"][i])
            table += [_pointer(parts[k]) for k in PER_LAYER]
        self.table = (ctypes.c_void_p * len(table))(*table)

    def _refusal(self, status: int, ids: torch.Tensor) -> Exception | None:
        """The error a call's negative ``status`` stands for (-1 - i: ``ids``' i-th token is
        outside the embedding table; ``TOO_MANY_ROWS``), or None."""
        if status >= 0:
            return None
        if status == TOO_MANY_ROWS:
            return ValueError(f"a prefill of {ids.numel()} positions is more than the {int(self.cfg[-1])} "
                              "rows this batch's buffers were made for")
        i = -1 - status
        return IndexError(f"token {int(ids.reshape(-1)[i])} at {i} is outside the embedding table "
                          f"(0..{self.weights.embed.shape[0] - 1})")

    def _refused(self, status: int, ids: torch.Tensor) -> None:
        if (error := self._refusal(status, ids)) is not None:
            raise error

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, repeats: int) -> torch.Tensor:
        """Run the (U, P) prompts; the next-token logits after each, (U, V)."""
        u, p = ids.shape
        if positions.shape != ids.shape or repeats < 1 or u * repeats > self.batch:
            raise ValueError(f"a prefill takes (U, P) ids and positions with U·repeats <= {self.batch} "
                             f"rows of cache; got ids {tuple(ids.shape)}, positions "
                             f"{tuple(positions.shape)}, repeats {repeats}")
        ids = ids.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        logits = torch.empty(u, self.weights.vocab, dtype=torch.float32)
        status = self.lib.tether_prefill(self.cfg.data_ptr(), self.eps, self.scale, self.table,
                                         ids.data_ptr(), positions.data_ptr(), u, p, repeats,
                                         logits.data_ptr())
        self._refused(status, ids)
        return logits

    def step(self, tokens: torch.Tensor, length: int, next_pos: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (B,) at slot ``length`` of every row, advance ``next_pos`` (B,) in
        place; the next logits, (B, V)."""
        if tokens.shape != (self.batch,):
            raise ValueError(f"decode takes one token per row, ({self.batch},); got {tuple(tokens.shape)}")
        tokens = tokens.to(torch.int64).contiguous()
        logits = torch.empty(self.batch, self.weights.vocab, dtype=torch.float32)
        status = self.lib.tether_decode_step(self.cfg.data_ptr(), self.eps, self.scale, self.table, length,
                                             tokens.data_ptr(), next_pos.data_ptr(), logits.data_ptr())
        self._refused(status, tokens)
        return logits

    def run(self, length: int, steps: int, tokens: torch.Tensor, logps: torch.Tensor, col: int,
            next_pos: torch.Tensor, temperature: float, uniforms: torch.Tensor | None, stop: torch.Tensor,
            done: torch.Tensor, lengths: torch.Tensor) -> tuple[int, IndexError | None]:
        """Up to ``steps`` decode steps, each decoding a column of ``tokens`` / ``logps`` ((B, N)
        int64 and float32, contiguous) from column ``col`` on and sampling the next from its
        logits (``sample_rows``: the untruncated draw of ``tether.decoding.sampling.sample``)
        with ``uniforms`` ((steps, B, V), or None: greedy), and marking rows that sample a
        ``stop`` id (int64) in ``done`` (bool) and ``lengths`` (int64), (B,) each, as
        ``tether.decoding.sampling.sample`` does; it ends early when every row is done (the
        ``tether_decode_run`` loop). Returns the steps run, and the error that stopped it if a
        token was outside the embedding table (the steps before it stand)."""
        b, vocab = self.batch, self.weights.vocab
        if (tokens.dtype != torch.int64 or logps.dtype != torch.float32 or tokens.shape != logps.shape
                or tokens.shape[0] != b or not tokens.is_contiguous() or not logps.is_contiguous()
                or col + steps >= tokens.shape[1]):
            raise ValueError(f"tokens and logps must be contiguous ({b}, N) int64 and float32 with room "
                             f"for {steps} more columns after column {col}")
        if done.dtype != torch.bool or lengths.dtype != torch.int64 or stop.dtype != torch.int64:
            raise ValueError("done, lengths and stop must be bool, int64 and int64")
        if uniforms is not None and (uniforms.shape != (steps, b, vocab) or not uniforms.is_contiguous()):
            raise ValueError(f"uniforms must be a contiguous ({steps}, {b}, {vocab}) tensor")
        ran = ctypes.c_int64(0)
        status = self.lib.tether_decode_run(
            self._cfg, self.eps, self.scale, self.table, length, steps, tokens.data_ptr(), logps.data_ptr(),
            tokens.stride(0), col, next_pos.data_ptr(), self._logits_ptr, temperature,
            uniforms.data_ptr() if uniforms is not None else None, stop.data_ptr(), stop.numel(),
            done.data_ptr(), lengths.data_ptr(), ctypes.byref(ran))
        return ran.value, self._refusal(int(status), tokens[:, col + ran.value])
