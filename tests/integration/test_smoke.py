"""Smoke tests: the installed `tether` command and the benchmarks run as real subprocesses."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def tether_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "tether"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("tether")
    return [found] if found else [sys.executable, "-m", "tether.cli.main"]


def test_demo_recipe_plans_from_the_console_script():
    out = subprocess.run([*tether_cmd(), "plan", "recipes/demo.yaml", "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert doc["settings"]["num_batches"] == len(doc["batches"])
    assert doc["summary"]["max_staleness_batches"] <= doc["settings"]["max_staleness"]


def test_console_script_reports_bad_input_on_stderr_with_exit_2():
    out = subprocess.run([*tether_cmd(), "plan", "recipes/demo.yaml", "train.num_batchs=3"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2
    assert "did you mean train.num_batches" in out.stderr
    assert out.stdout == ""


def test_loop_overhead_benchmark_runs_and_prints_json():
    out = subprocess.run([sys.executable, "benchmarks/loop_overhead.py", "--batches", "200",
                          "--repeats", "1", "--json"], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    figures = json.loads(out.stdout)
    assert set(figures["us_per_batch"]) == {"bare", "driver", "driver+trace", "threaded"}
    assert figures["overhead_us_per_batch"] > 0


def test_engine_and_channel_benchmarks_run_at_a_tiny_size():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "benchmarks/engine.py", "--size", "tiny", "--prompts", "4",
                          "--new-tokens", "4", "--repeats", "1", "--json"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["speedup_vs_hf_generate"] > 0 and set(figures["threads"]) == {"1", "2"}
    for row in figures["threads"].values():
        # figures only: which of two timings wins is the machine's load, not the code (both are
        # measured against a peak measured in the same run, and a busy core skews any of them)
        assert 0 < row["fraction_of_peak"] < math.inf and 0 < row["gemm_chain_fraction_of_peak"] < math.inf
        spread = row["spread"]["fraction_of_peak"]
        assert spread["min"] <= row["fraction_of_peak"] == spread["median"] <= spread["max"]
        assert row["kept"] + len(row["dropped"]) == row["rounds"] == 2  # --repeats 1, and a warm-up
    out = subprocess.run([sys.executable, "benchmarks/weight_channel.py", "--size", "tiny", "--repeats", "2",
                          "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    channel = json.loads(out.stdout)
    assert 0 < channel["fraction_of_memcpy"]["min"] <= channel["fraction_of_memcpy"]["median"]
    assert channel["kept"] + len(channel["dropped"]) == channel["rounds"] == 3


def test_engine_profile_splits_a_native_step_into_its_sections():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "benchmarks/engine.py", "--profile", "--size", "tiny",
                          "--prompts", "4", "--new-tokens", "4", "--json"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    native = r["native"]["parts_ms"]
    assert {"attention", "gate/up GEMM", "sampling"} <= set(native) and native["gate/up GEMM"] > 0
    assert sum(native.values()) == pytest.approx(r["native"]["step_ms"], rel=0.05)  # the rest is "outside"
    assert r["python"]["parts_ms"]["sampling (log_softmax, rand, log, argmax, gather)"] > 0


@pytest.mark.timeout(600)  # two benchmarks of several runs each (42 s on an idle machine)
def test_overlap_and_ray_backend_benchmarks_run_at_a_tiny_size():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "benchmarks/overlap.py", "--batches", "4", "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=400)
    figures = json.loads(out.stdout)  # progress goes to stderr: stdout is the figures only
    assert set(figures["fraction_of_ideal"]) == {"1", "2", "1+idle", "2+idle"}
    assert all(0 <= m["trainer_idle_fraction"] <= 1 for m in figures["settings"].values())
    pytest.importorskip("ray")
    out = subprocess.run([sys.executable, "benchmarks/ray_backend.py", "--size", "tiny", "--repeats", "2",
                          "--json"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=400)
    figures = json.loads(out.stdout)
    assert figures["publish_ratio_ray_vs_local"] > 0 and figures["batch_overhead_ratio_ray_vs_local"] > 0


def test_flow_settle_benchmark_continues_a_warm_start_and_saves_it(tmp_path):
    # a built-in flow model built with a 5-step warm start, then 2 more flow-matching steps
    model, settled = tmp_path / "flow", tmp_path / "settled"
    out = subprocess.run([sys.executable, "benchmarks/flow_settle.py", "recipes/flow-demo.yaml",
                          f"model.path={model}", "warmstart.max_steps=5", "data.num_eval=16",
                          "train.threads=1", "--steps", "2", "--every", "1", "--save", str(settled),
                          "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert [e["step"] for e in record["evaluations"]] == [0, 1, 2]
    assert all(0 <= e["reward"] <= 1 and 0 <= e["pass_at_1"] <= 1 for e in record["evaluations"])
    assert (settled / "warmstart.json").read_text() == (model / "warmstart.json").read_text()
    from tether.modeling import is_model_dir

    assert is_model_dir(settled) and is_model_dir(model)


def test_flow_guidance_benchmarks_measure_both_gradients_and_both_branches_on_a_fresh_build(tmp_path):
    # a built-in flow model with condition dropout and a 5-step warm start; one batch measured
    out = subprocess.run([sys.executable, "benchmarks/flow_cfg_grad.py", "--batches", "1", "--model",
                          str(tmp_path / "flow"), "--json", "warmstart.max_steps=5", "data.num_eval=16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    (row,) = record["batches"]
    assert record["guidance"] == 4.5 and 0 <= row["reward_mean"] <= 1
    assert -1 <= row["cosine"] <= 1 and row["norm_full"] >= 0 and row["norm_conditional"] >= 0
    assert json.loads((tmp_path / "flow" / "warmstart.json").read_text())["settings"]["cond_dropout"] == 0.1
    # the same model as both branches of guidance: its own guided reward, on each split
    model = str(tmp_path / "flow")
    out = subprocess.run([sys.executable, "benchmarks/flow_guidance_parts.py", "recipes/flow-demo.yaml",
                          "--cond", model, "--uncond", model, "--guidance", "4.5", "--examples", "16",
                          "--json", f"model.path={model}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    parts = json.loads(out.stdout)
    assert parts["guidance"] == 4.5 and 0 <= parts["trained"] <= 1 and 0 <= parts["held_out"] <= 1
    from tether.families.flow import scenes

    for split in ("trained", "held_out"):  # each check's share of the split's 16 images
        shares = parts["checks"][split]
        assert list(shares) == list(scenes.CHECKS)
        assert all(share * 16 == int(share * 16) for share in shares.values())
        # an image's reward is the squared share of its words passed, gated by its background: at
        # most that share, so the split's reward is at most the words' mean share and the background's
        words = [shares[check] for check in scenes.WORDS_CHECKED]
        assert parts[split] <= min(sum(words) / 4, shares["background"]) + 1e-9


def test_the_sd3_tokenizer_benchmark_times_both_tokenizers_on_the_recipes_batch():
    # two untrained tiny pipelines at a small width, one timed round each after the warm-up round
    out = subprocess.run([sys.executable, "benchmarks/flow_sd3_tokens.py", "--repeats", "1", "--json",
                          "flow.init_width=32", "flow.init_depth=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert (record["width"], record["depth"], record["samples_per_batch"]) == (32, 1, 64)
    rows = record["rows"]
    assert [(r["tokens"], r["max_prompt_tokens"]) for r in rows] == [("characters", 32), ("words", 8)]
    assert rows[0]["gen_speedup"] == rows[0]["learner_speedup"] == 1.0
    assert all(r[k] > 0 for r in rows for k in ("gen_s", "gen_cpu_s", "learner_s", "learner_cpu_s"))
