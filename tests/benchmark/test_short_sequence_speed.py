"""benchmarks/short_sequence_speed.py: a tiny run measures every attention against SDPA in the same run, finds
crossovers from its own sweep, profiles RA, and writes its JSON and plot; bad sizes say what to change."""

from __future__ import annotations

import json

import pytest

from tests.scripts_helpers import ROOT, load_module

bench = load_module(ROOT / "benchmarks", "short_sequence_speed")


def test_tiny_run_measures_every_attention_against_sdpa(tmp_path):
    results = tmp_path / "short.json"
    report = bench.main(["--tiny", "--threads", "1", "--results", str(results)])
    assert json.loads(results.read_text()) == report and results.with_suffix(".png").stat().st_size > 0
    names = list(bench.ATTENTIONS)
    assert list(report["classifier_step_seconds"]) == names and report["classifier_ratio_to_sdpa"]["sdpa"] == 1.0
    assert all(seconds > 0 for seconds in report["classifier_step_seconds"].values())
    assert set(report["sweep_step_seconds"]) == {"32", "64"}
    # a crossover is the shortest swept length at which the attention beat SDPA, or None when it never did
    for name, length in report["crossover_length"].items():
        faster = [int(n) for n, row in report["sweep_ratio_to_sdpa"].items() if row[name] < 1.0]
        assert length == (min(faster) if faster else None)
    assert report["ra_profile"] and {"operator", "self_cpu_ms", "share", "calls"} <= set(report["ra_profile"][0])
    assert report["setup"]["threads"] == 1


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--heads", "3"), ("--crossover_lengths", "1"),
                                         ("--threads", "-1")])
def test_bad_sizes_say_what_to_change(flag, value):
    with pytest.raises(ValueError, match=flag):
        bench.main([flag, value])
