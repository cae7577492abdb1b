"""benchmarks/training_memory.py: a one-layer run measures a training step of every design against transformers'
SDPA Llama in the same run (workers run in this process here), keeps each row as it is measured, reruns only missing
rows and writes its JSON and plot; bad sizes name the flag."""

from __future__ import annotations

import json
import math

import pytest

from tests.benchmark.workers import workers_in_process
from tests.scripts_helpers import ROOT, load_module

bench = load_module(ROOT / "benchmarks", "training_memory")
TINY = ["--layers", "1", "--lengths", "128", "--threads", "1"]


@pytest.fixture
def in_process(monkeypatch):
    yield from workers_in_process(bench, monkeypatch)


def test_a_tiny_run_measures_a_training_step_of_each_design_against_the_source(tmp_path, in_process):
    results = tmp_path / "training.json"
    bench.main([*TINY, "--results", str(results)])
    report = json.loads(results.read_text())
    assert results.with_suffix(".png").stat().st_size > 0
    assert {(r["model"], r["length"]) for r in report["rows"]} == {(m, 128) for m in bench.MODELS}
    for row in report["rows"]:
        # seeded random weights predict about uniformly over the vocabulary: the step ran over real logits
        assert row["step_s"] > 0 and row["peak_growth_mib"] >= 0
        assert row["loss"] == pytest.approx(math.log(bench.SMOLLM2["vocab_size"]), abs=0.5)
    source = next(r for r in report["rows"] if r["model"] == "source")
    for model in bench.DESIGNS:
        row = next(r for r in report["rows"] if r["model"] == model)
        entry = report["summary"][f"{model}/128"]
        assert entry["step_time_over_source"] == pytest.approx(row["step_s"] / source["step_s"])
    # the same setup again measures nothing; --remeasure measures every row asked for
    in_process.clear()
    bench.main([*TINY, "--results", str(results)])
    assert in_process == []
    bench.main([*TINY, "--results", str(results), "--models", "window", "--remeasure"])
    assert [job["model"] for job in in_process] == ["window"]
    assert len(json.loads(results.read_text())["rows"]) == len(bench.MODELS)


def test_a_worker_that_fails_leaves_no_row_and_the_others_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_worker", lambda script, args: None if json.loads(args[0])["model"] == "window"
                        else {"step_s": 1.0, "peak_growth_mib": 2.0, "loss": 10.8})
    results = tmp_path / "training.json"
    bench.main(["--lengths", "1024", "--results", str(results)])
    report = json.loads(results.read_text())
    assert {r["model"] for r in report["rows"]} == {"source", "block_wide_quantised"}
    assert report["summary"] == {"block_wide_quantised/1024": {"step_time_over_source": 1.0,
                                                               "peak_memory_over_source": 1.0}}


@pytest.mark.parametrize("flag, value", [("--lengths", "64"), ("--threads", "0")])
def test_bad_sizes_name_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit):
        bench.main([flag, value])
    assert flag in capsys.readouterr().err
