"""The native decode step: the same logits and KV cache as the Python path, on every model kind the
lean decoder takes; rebuilt after a mid-generation weight change; what happens when it cannot be
built; and a cache that concurrent first uses share."""

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tether.decoding import native  # noqa: E402
from tether.decoding.fast_decoder import FastDecoder  # noqa: E402
from tether.decoding.native import builder  # noqa: E402
from tether.errors import ConfigError, NativeDecoderError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _model(kind: str):
    """A tiny model of each shape the step branches on: Qwen3's q/k norms and SiLU; Llama with
    q/k/v and o biases and GELU; Qwen2's q/k/v biases and a head width of 64."""
    torch.manual_seed(0)
    common = dict(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common)
    elif kind == "llama-biases-gelu":
        cfg = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                                       hidden_act="gelu", **common)
    else:
        cfg = transformers.Qwen2Config(num_attention_heads=1, num_key_value_heads=1, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # biases and norm weights away from their initial 0 and 1
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(length: int = 7):
    """Three left-padded prompts. From 32 tokens a prompt the native prefill attends through
    GEMMs (decode_step.c's GEMM_ATTENTION_MIN), below through loops."""
    ids = torch.randint(3, 40, (3, length))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    return ids, mask


def _decode_both(model, steps: int, *, reload_at: int | None = None, length: int = 7):
    """Run the native and the Python path side by side from one prefill; the largest logit
    difference seen, and the two decoders."""
    ids, mask = _batch(length)
    fast, slow = FastDecoder(model, decoder="native"), FastDecoder(model, decoder="python")
    a = fast.prefill(ids, mask, steps + 1, repeats=2)
    b = slow.prefill(ids, mask, steps + 1, repeats=2)
    worst = (a - b).abs().max().item()
    gen = torch.Generator().manual_seed(0)
    for t in range(steps):
        if t == reload_at:  # new weights mid-generation: both re-read them, their caches stay
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            fast.reload()
            slow.reload()
        tokens = torch.multinomial(torch.softmax(b, -1), 1, generator=gen).squeeze(-1)
        a, b = fast.decode(tokens), slow.decode(tokens)
        assert fast.path == "native" and slow.path == "python", fast.native_reason
        worst = max(worst, (a - b).abs().max().item())
    return worst, fast, slow


@pytest.mark.parametrize("kind", ["qwen3", "llama-biases-gelu", "qwen2"])
def test_native_step_gives_the_python_paths_logits_and_cache(kind):
    worst, fast, slow = _decode_both(_model(kind), steps=12)
    assert worst < 1e-5
    assert fast.length == slow.length and torch.equal(fast.next_pos, slow.next_pos)
    for mine, theirs in zip(fast.k_cache + fast.v_cache, slow.k_cache + slow.v_cache, strict=True):
        written = slice(0, fast.length)
        assert torch.allclose(mine[:, :, written], theirs[:, :, written], atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "llama-biases-gelu"])
def test_long_prompts_prefill_through_gemms_to_the_same_logits(kind):
    worst, fast, slow = _decode_both(_model(kind), steps=4, length=40)
    assert worst < 1e-5
    for mine, theirs in zip(fast.k_cache + fast.v_cache, slow.k_cache + slow.v_cache, strict=True):
        assert torch.allclose(mine[:, :, :fast.length], theirs[:, :, :fast.length], atol=1e-5)


def test_a_weight_change_mid_generation_rebuilds_the_native_step():
    worst, _, _ = _decode_both(_model("qwen3"), steps=8, reload_at=4)
    assert worst < 1e-5  # a step still reading the old weights would differ by far more


def test_sampling_runs_native_and_matches_a_teacher_forced_forward(tiny_model_dir):
    from tether.decoding.sampling import SamplingParams, sample

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    stepper = FastDecoder(model, decoder="native")
    ps = [tok(t, add_special_tokens=False).input_ids for t in ("1+1=", "12+345=", "rev abc=")]
    out = sample(model, ps, SamplingParams(max_new_tokens=12), stop_ids=[], pad_id=tok.pad_token_id,
                 generator=torch.Generator().manual_seed(0), stepper=stepper, samples_per_prompt=3)
    assert stepper.path == "native"
    for row, (toks, lps) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
        prompt = ps[row // 3]
        logits = model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1: -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(lps), expected, atol=1e-5)


def test_a_token_outside_the_table_is_refused_and_changes_nothing():
    model = _model("qwen3")
    dec = FastDecoder(model, decoder="native")
    ids, mask = _batch()
    dec.prefill(ids, mask, 4)
    before = dec.next_pos.clone()
    with pytest.raises(IndexError, match="token 40 at 1 is outside the embedding table"):
        dec.decode(torch.tensor([1, 40, 2]))
    assert dec.length == ids.shape[1] and torch.equal(dec.next_pos, before)
    with pytest.raises(ValueError, match="one token per row"):
        dec.decode(torch.tensor([1, 2]))


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """An empty cache folder and no library loaded yet in this process."""
    monkeypatch.setenv("TETHER_CACHE_DIR", str(tmp_path / "cache"))
    native._attempt.cache_clear()
    native._said.clear()
    yield tmp_path / "cache"
    native._attempt.cache_clear()


def _decodes(model, decoder: str) -> FastDecoder:
    dec = FastDecoder(model, decoder=decoder)
    ids, mask = _batch()
    logits = dec.prefill(ids, mask, 3)
    dec.decode(logits.argmax(-1))
    return dec


def test_off_never_builds(fresh_native):
    dec = _decodes(_model("qwen3"), "python")
    assert dec.path == "python" and dec.native_reason == "rollout.decoder=python"
    assert not fresh_native.exists()


def test_without_a_compiler_auto_says_why_once_and_decodes_in_python(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="tether.decoding.native"):
        for _ in range(2):
            assert _decodes(_model("qwen3"), "auto").path == "python"
    said = [r.getMessage() for r in caplog.records if "native decode step unavailable" in r.getMessage()]
    assert len(said) == 1 and "/nonexistent/cc" in said[0] and "rollout.decoder=python" in said[0]


def test_without_a_compiler_on_is_an_error_that_says_why(fresh_native, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(NativeDecoderError, match=r"rollout.decoder=native but .*/nonexistent/cc"):
        _decodes(_model("qwen3"), "native")


def test_on_with_a_model_it_cannot_run_says_why():
    with pytest.raises(NativeDecoderError, match=r"not float32; use rollout\.decoder"):
        _decodes(_model("qwen3").to(torch.bfloat16), "native")
    assert _decodes(_model("qwen3").to(torch.bfloat16), "auto").path == "python"


def test_a_build_that_fails_leaves_no_partial_library(fresh_native, monkeypatch, tmp_path):
    broken = tmp_path / "cc"
    broken.write_text('#!/bin/sh\ncase "$1" in --version) echo cc 1;; *) echo nope >&2; exit 1;; esac\n')
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(NativeDecoderError, match=r"failed to build decode_step\.c: nope"):
        native.library("native")
    assert list((fresh_native / "native").glob("*.so*")) == []


def test_a_bad_mode_is_refused():
    with pytest.raises(ConfigError, match="decoder 'sometimes': use auto, native or python"):
        FastDecoder(_model("qwen3"), decoder="sometimes")


def test_concurrent_first_uses_share_one_library(fresh_native):
    """Two processes build into an empty cache at once (a pool's workers starting): both load
    it, one library is left, no partial file."""
    script = textwrap.dedent("""
        from tether.decoding import native
        lib = native.library("native")
        print(native.build())
    """)
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    paths = {run.communicate(timeout=120)[0].strip() for run in runs}
    assert all(run.returncode == 0 for run in runs)
    assert len(paths) == 1
    assert [p.name for p in (fresh_native / "native").glob("*.so*")] == [os.path.basename(paths.pop())]


def test_a_run_that_requires_the_native_decoder_without_a_compiler_fails_before_it_starts(
        tiny_model_dir, tmp_path):
    from test_train import ROOT, recipe

    env = dict(os.environ, CC="/nonexistent/cc", TETHER_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", "tether.cli.main", "train", "--run-dir",
                          str(tmp_path / "never"), *recipe(tiny_model_dir, "rollout.decoder=native")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "rollout.decoder=native but the native decoder cannot run here" in out.stderr
    assert "/nonexistent/cc" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "never" / "metrics.jsonl").exists()


class _Unfused(FastDecoder):
    """The native decoder with its sampler hidden: sample() then draws in torch, from its logits."""

    samples_natively = False


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("loop", ["native run", "native steps"])
def test_the_native_sampler_draws_what_the_torch_sampler_draws(tiny_model_dir, temperature, stops, loop):
    """The native decoder samples inside its decode calls, from the uniforms the torch sampler
    would have drawn: with nothing polling for new weights, the whole loop in native calls
    (stop ids checked there), else one call a step (the same decode_run). Either way the
    same generator seed gives the same tokens, log-probs (to float32 rounding) and stops as the
    torch sampler over the native logits, greedy included."""
    from tether.decoding.sampling import SamplingParams, sample

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    ps = [tok(t, add_special_tokens=False).input_ids for t in ("1+1=", "12+345=", "rev abc=", "7*8=")]
    params = SamplingParams(max_new_tokens=16, temperature=temperature)
    poll = (lambda: None) if loop == "native steps" else None
    stop_ids = []
    if stops:  # a token the model does sample: the one 4 steps into row 0's unstopped sample
        free = sample(model, ps, params, stop_ids=[], pad_id=tok.pad_token_id, samples_per_prompt=4,
                      stepper=_Unfused(model, decoder="native"), generator=torch.Generator().manual_seed(3))
        stop_ids = [free.tokens[0][3]]
    runs = []
    for stepper in (FastDecoder(model, decoder="native"), _Unfused(model, decoder="native")):
        runs.append(sample(model, ps, params, stop_ids=stop_ids, pad_id=tok.pad_token_id, stepper=stepper,
                           generator=torch.Generator().manual_seed(3), samples_per_prompt=4, poll=poll))
        assert stepper.path == "native"
    fused, unfused = runs
    assert fused.tokens == unfused.tokens and fused.finish_reasons == unfused.finish_reasons
    if stops:
        assert "stop" in fused.finish_reasons and len(fused.tokens[0]) <= 4
    for a, b in zip(fused.logprobs, unfused.logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


def _native_run_buffers(columns: int):
    """A native decoder prefilled for ``columns`` more tokens of _batch(), and the sampler's
    buffers for decode_run: tokens, log-probs (3, columns), done, lengths, no stop ids."""
    dec = FastDecoder(_model("qwen3"), decoder="native")
    ids, mask = _batch()
    dec.prefill(ids, mask, columns)
    toks, lps = torch.ones(3, columns, dtype=torch.int64), torch.zeros(3, columns)
    done, lengths = torch.zeros(3, dtype=torch.bool), torch.full((3,), columns)
    return dec, ids.shape[1], toks, lps, done, lengths, torch.empty(0, dtype=torch.long)


def test_the_native_sampler_refuses_mismatched_buffers():
    dec, prompt, toks, lps, done, lengths, stop = _native_run_buffers(4)
    with pytest.raises(ValueError, match=r"uniforms must be a contiguous \(1, 3, 40\)"):
        dec.decode_run(1, toks, lps, 0, 1.0, torch.rand(1, 3, 7), stop, done, lengths)
    with pytest.raises(ValueError, match="contiguous \\(3, N\\) int64 and float32"):
        dec.decode_run(1, toks, lps.double(), 0, 1.0, None, stop, done, lengths)
    with pytest.raises(ValueError, match="contiguous \\(3, N\\) int64 and float32"):
        dec.decode_run(1, toks.t().contiguous().t(), lps, 0, 1.0, None, stop, done, lengths)
    with pytest.raises(ValueError, match="done, lengths and stop must be bool, int64 and int64"):
        dec.decode_run(1, toks, lps, 0, 1.0, None, stop, done.long(), lengths)
    assert dec.length == prompt  # nothing ran
    assert dec.decode_run(1, toks, lps, 0, 1.0, torch.rand(1, 3, 40), stop, done, lengths) == 1
    assert dec.length == prompt + 1 and (lps[:, 1] < 0).all()


def test_a_native_run_refuses_a_token_outside_the_table_and_keeps_the_steps_before():
    dec, prompt, toks, lps, done, lengths, stop = _native_run_buffers(6)
    assert dec.decode_run(2, toks, lps, 0, 1.0, torch.rand(2, 3, 40), stop, done, lengths) == 2
    assert dec.length == prompt + 2 and (lps[:, 1:3] < 0).all()
    toks[1, 2] = 40  # the next step would embed it
    with pytest.raises(IndexError, match="token 40 at 1 is outside the embedding table"):
        dec.decode_run(2, toks, lps, 2, 1.0, torch.rand(2, 3, 40), stop, done, lengths)
    assert dec.length == prompt + 2  # the refused step did not count
    with pytest.raises(ValueError, match="room for 4 more columns"):
        dec.decode_run(4, toks, lps, 2, 1.0, None, stop, done, lengths)


BUILDS = pytest.mark.skipif(native.library("auto") is None, reason="the native decoder does not build here")


def counting_compiler(tmp_path, *, sleep: float = 0.0):
    """A CC that logs each build it is asked for (not --version), then runs the real compiler
    (after ``sleep`` seconds, in a child, as a slow compiler driver would)."""
    import shutil

    real = shutil.which("cc") or shutil.which("gcc")
    log = tmp_path / "builds.log"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ncase "$1" in --version) exec {real} --version;; esac\n'
                  f'echo build >> {log}\n' + (f"sleep {sleep} & echo $! > {tmp_path / 'child.pid'}; wait\n"
                                               if sleep else "") + f'exec {real} "$@"\n')
    cc.chmod(0o755)
    return cc, log


@BUILDS
def test_concurrent_first_builds_compile_once(fresh_native, tmp_path, monkeypatch):
    """Three processes start on an empty cache at once (a pool's workers): one compiles while the
    others wait on the lock, then all load the one library."""
    cc, log = counting_compiler(tmp_path)
    env = dict(os.environ, CC=str(cc), TETHER_CACHE_DIR=str(fresh_native))
    script = "from tether.decoding import native; native.library('native'); print(native.build())"
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(3)]
    paths = {run.communicate(timeout=180)[0].strip() for run in runs}
    assert all(run.returncode == 0 for run in runs) and len(paths) == 1
    assert log.read_text().count("build") == 1


@BUILDS
def test_a_bad_file_at_the_librarys_name_is_built_afresh_and_stale_builds_go(fresh_native):
    """A valid ELF that is not the library (a copy of libm), or garbage, at the computed name: the
    default decoder builds the library again instead of failing (or falling back for good).
    Libraries of another version of the source are removed when one is built."""
    target = native.build()
    stale = target.parent / "decode_step-0badf00d-0123456789abcdef.so"
    stale.write_bytes(b"old")
    libm = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                            "/lib64/libm.so.6", "/usr/lib64/libm.so.6") if os.path.exists(p))
    for planted in (Path(libm).read_bytes(), b"not a library at all"):
        fake = target.with_suffix(".fake")
        fake.write_bytes(planted)
        os.replace(fake, target)  # a new file (writing into the loaded one would change its mapping)
        native._attempt.cache_clear()
        assert native.library("auto") is not None
        assert target.read_bytes() != planted
    assert not stale.exists()


@BUILDS
def test_a_library_from_a_folder_others_can_write_is_refused(fresh_native, caplog):
    """The library runs in every worker: one under a group- or world-writable folder, or owned by
    someone else, could be anyone's. Refused, saying why; auto decodes in Python."""
    folder = native.build().parent
    folder.chmod(0o775)
    native._attempt.cache_clear()
    with pytest.raises(NativeDecoderError, match=r"cache folder .* can be written by others \(mode 0o775\)"):
        native.library("native")
    with caplog.at_level(logging.WARNING, logger="tether.decoding.native"):
        assert native.library("auto") is None
    assert "can be written by others" in caplog.text
    folder.chmod(0o700)
    target = native.build()
    target.chmod(0o777)
    native._attempt.cache_clear()
    with pytest.raises(NativeDecoderError, match=r"library .* can be written by others \(mode 0o777\)"):
        native.library("native")
    if os.getuid() == 0:  # root can hand the folder to someone else
        target.chmod(0o700)
        os.chown(folder, 12345, 12345)
        native._attempt.cache_clear()
        with pytest.raises(NativeDecoderError, match=r"belongs to another user \(uid 12345\)"):
            native.library("native")


@BUILDS
def test_a_new_cache_folder_is_private(fresh_native):
    assert (native.build().parent.stat().st_mode & 0o777) == 0o700


def test_a_compiler_past_the_time_limit_is_stopped_with_its_children_and_auto_falls_back(
        fresh_native, tmp_path, monkeypatch, caplog):
    cc, _log = counting_compiler(tmp_path, sleep=60)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(builder, "BUILD_TIMEOUT_S", 1.0)
    with caplog.at_level(logging.WARNING, logger="tether.decoding.native"):
        assert native.library("auto") is None
    assert "took more than 1s to build decode_step.c, and was stopped" in caplog.text
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the compiler's child outlived the build"
    assert list((fresh_native / "native").glob("*.so*")) == []


@BUILDS
def test_a_library_of_another_interface_is_refused(fresh_native, monkeypatch):
    monkeypatch.setattr(native, "INTERFACE", native.INTERFACE + 1)
    native._attempt.cache_clear()
    v = native.INTERFACE - 1  # the library's own
    with pytest.raises(NativeDecoderError, match=rf"speaks another interface \(version and table sizes "
                                                  rf"\({v}, 15, 7, 10, 10\), this Tether's "
                                                  rf"\({v + 1}, 15, 7, 10, 10\)\)"):
        native.library("native")


@BUILDS
def test_a_prefill_past_its_buffers_says_so_and_arguments_are_checked():
    dec = FastDecoder(_model("qwen3"), decoder="native")
    ids, mask = _batch()
    dec.prefill(ids, mask, 3)
    batch = dec._batch
    too_many = batch._refusal(native.TOO_MANY_ROWS, ids)
    assert isinstance(too_many, ValueError) and "rows this batch's buffers were made for" in str(too_many)
    with pytest.raises(ValueError, match=r"a prefill takes \(U, P\) ids and positions"):
        batch.prefill(ids, ids[:, :-1], 3)
