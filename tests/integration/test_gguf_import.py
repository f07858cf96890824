"""`tether init-model --from-gguf` on a tiny GGUF file written here (tests/gguf_files.py): the
plain folder it writes, the same model transformers reads from the file, the lean decoder on it,
and every refusal, each before anything is written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf_files import CHAT_TEMPLATE, write_tiny_gguf  # noqa: E402
from tether.decoding.fast_decoder import FastDecoder, supports  # noqa: E402
from tether.decoding.sampling import SamplingParams, sample  # noqa: E402
from tether.modeling import load_causal_lm  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
TETHER = [sys.executable, "-m", "tether.cli.main"]


def run(*args):
    return subprocess.run([*TETHER, *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the GGUF file, the folder `tether init-model --from-gguf` wrote from it)."""
    root = tmp_path_factory.mktemp("gguf")
    file = write_tiny_gguf(root / "tiny.gguf")
    res = run("init-model", "--from-gguf", file, root / "model")
    assert res.returncode == 0, res.stderr
    assert "wrote a llama model" in res.stdout and "with its chat template" in res.stdout
    return file, root / "model"


def test_the_folder_is_a_plain_checkpoint_with_the_files_weights_and_chat_template(imported):
    file, out = imported
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # loads without the GGUF loader (and gguf)
    assert config["tie_word_embeddings"] and config["rope_parameters"]["rope_theta"] == 100000.0
    assert not list(out.parent.glob(".model.*"))  # no staging folder left
    assert out.stat().st_mode & 0o755 == 0o755  # an ordinary folder, not mkdtemp's private one
    model, tok = load_causal_lm(out)
    reference = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name)
    ours = model.state_dict()
    assert all(torch.equal(ours[k], v) for k, v in reference.state_dict().items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 4 + 7?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 4 + 7?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_the_lean_decoder_samples_the_imported_model_as_its_forward_scores_it(imported):
    """Tied embeddings, rope theta 1e5 and the file's RMSNorm eps, on both lean decode paths."""
    model, tok = load_causal_lm(imported[1])
    model.eval()
    assert supports(model)
    prompts = [tok(t, add_special_tokens=False).input_ids for t in ("What is 4 + 7?", "the theta")]
    for decoder in ("native", "python"):
        stepper = FastDecoder(model, decoder=decoder)
        out = sample(model, prompts, SamplingParams(max_new_tokens=8), stop_ids=[], pad_id=tok.pad_token_id,
                     generator=torch.Generator().manual_seed(0), stepper=stepper, samples_per_prompt=2)
        assert stepper.path == decoder
        for row, (toks, lps) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
            prompt = prompts[row // 2]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1: -1]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None]).squeeze(-1)
            assert (torch.tensor(lps) - expected).abs().max() <= 1e-5, decoder


def test_dtype_writes_the_weights_in_that_dtype(imported, tmp_path):
    from safetensors import safe_open

    res = run("init-model", "--from-gguf", imported[0], tmp_path / "bf16", "--dtype", "bfloat16")
    assert res.returncode == 0, res.stderr
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        names = f.keys()  # safe_open has no __iter__
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}


def _refused(tmp_path: Path, file, out, *needles: str) -> None:
    """The command (in this process) exits 2 with a message holding ``needles``, and writes nothing."""
    import contextlib
    import io

    from tether.cli.main import main

    before = sorted(p.name for p in tmp_path.iterdir())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["init-model", "--from-gguf", str(file), str(out)])
    assert code == 2, err.getvalue()
    for needle in needles:
        assert needle in err.getvalue(), err.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, nothing left


def test_a_missing_file_is_refused(tmp_path):
    _refused(tmp_path, tmp_path / "nope.gguf", tmp_path / "m", "nope.gguf: no such file")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 not a gguf file")
    _refused(tmp_path, tmp_path / "model.bin", tmp_path / "m", "is not a GGUF file",
             "point model.path at a Hugging Face model folder")


def test_a_cut_file_is_refused(imported, tmp_path):
    whole = imported[0].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    _refused(tmp_path, tmp_path / "cut.gguf", tmp_path / "m", "is damaged or cut short", "download it again")


def test_a_file_damaged_in_place_is_refused_naming_the_tensor(imported, tmp_path):
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(imported[0]).tensors if t.name == "blk.1.ffn_down.weight")
    data = bytearray(imported[0].read_bytes())
    data[tensor.data_offset:tensor.data_offset + 64] = b"\xff" * 64  # 16 float32 NaNs
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    _refused(tmp_path, tmp_path / "bad.gguf", tmp_path / "m", "is damaged: its tensor",
             "mlp.down_proj.weight holds 16 values that are not finite", "download it again")


def test_an_architecture_transformers_cannot_read_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "rwkv.gguf", architecture="rwkv6")
    _refused(tmp_path, tmp_path / "rwkv.gguf", tmp_path / "m",
             "transformers cannot read a GGUF model of architecture 'rwkv6'")


def test_an_output_folder_that_holds_files_is_refused(imported, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("mine")
    _refused(tmp_path, imported[0], tmp_path / "m", "already exists and is not empty")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["keep.txt"]
    res = run("init-model", "--from-gguf", imported[0], tmp_path / "m", "--overwrite")
    assert res.returncode == 2 and "--overwrite does not apply to --from-gguf" in res.stderr
