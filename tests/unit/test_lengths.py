"""Length against staleness from a run directory's records: by staleness level, generated against
trained (dropped batches), and what per-sample cutoffs would have kept."""

import json

import pytest

from tether.runtime.lengths import length_bias, plot, summary_lines


def write(run, name, rows):
    (run / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run(tmp_path):
    (tmp_path / "config.yaml").write_text("train:\n  updates_per_batch: 2\n")
    # three batches trained at versions 0, 2 and 4 after launch at 0, 0 and 2
    write(tmp_path, "metrics.jsonl", [
        {"step": 1, "async/behavior_version": 0, "staleness/updates": 0},
        {"step": 2, "async/behavior_version": 0, "staleness/updates": 2},
        {"step": 3, "async/behavior_version": 2, "staleness/updates": 2}])
    write(tmp_path, "samples.jsonl", [
        {"step": 1, "tokens": 4, "versions": [0, 0]}, {"step": 1, "tokens": 6, "versions": [0, 0]},
        {"step": 2, "tokens": 10, "versions": [0, 1]}, {"step": 2, "tokens": 20, "versions": [0, 2]},
        {"step": 3, "tokens": 12, "versions": [2, 2]}, {"step": 3, "tokens": 8, "versions": [3, 3]},
        {"step": 3, "tokens": 5, "versions": []}])  # nothing sampled: left out
    write(tmp_path, "events.jsonl", [{"kind": "drop", "batch": 9, "detail": {
        "staleness_updates": 6, "samples": 2, "length_mean": 30.0}}])
    return tmp_path


def test_lengths_by_staleness_generated_against_trained_and_cutoffs(run):
    bias = length_bias(run)
    assert bias["samples"] == 6 and bias["trained_mean"] == pytest.approx(60 / 6)
    assert bias["generated_mean"] == pytest.approx((60 + 60) / 8) and bias["dropped_batches"] == 1
    assert bias["by_staleness"]["0"] == {"batches": 0.0, "samples": 2, "mean": 5.0, "p90": 6.0}
    assert bias["by_staleness"]["1"]["samples"] == 1 and bias["by_staleness"]["1"]["mean"] == 8
    assert bias["by_staleness"]["2"] == {"batches": 1.0, "samples": 3, "mean": 14.0, "p90": 20.0}
    (k0, k1) = bias["cutoffs"]
    assert (k0["max_staleness_updates"], k0["kept_frac"], k0["mean"]) == (0, 2 / 6, 5.0)
    assert k0["bias"] == pytest.approx(5 / 10 - 1) and k1["mean"] == pytest.approx(6.0)
    lines = summary_lines(bias)
    assert "(1 batch(es) dropped)" in lines[0] and "k=0: 33% kept, mean 5.0 (-50.0%)" in lines[2]
    assert plot(bias, run / "lengths.png").stat().st_size > 5000


def test_a_run_without_records_has_no_length_figures(run):
    (run / "samples.jsonl").unlink()
    assert length_bias(run) is None
