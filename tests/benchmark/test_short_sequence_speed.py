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


def test_the_readme_shows_the_committed_crossovers():
    reports = bench.committed_reports()
    assert "cpu" in reports
    table = bench.crossover_table(reports)
    readme = (ROOT / "README.md").read_text()
    assert f"{bench.TABLE_START}\n{table}\n{bench.TABLE_END}" in readme
    cpu = reports["cpu"]
    rows = {line.split(" | ")[0].strip("| `"): line for line in table.splitlines()[2:]}
    assert set(rows) == set(cpu["crossover_length"])
    for name, crossover in cpu["crossover_length"].items():
        expected = f"{crossover:,} tokens" if crossover else f"not up to {max(cpu['setup']['crossover_lengths']):,}"
        assert f"| {cpu['classifier_ratio_to_sdpa'][name]:.2f} | {expected} |" in rows[name]


def test_readme_rewrite_replaces_only_the_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{bench.TABLE_START}\nold\n{bench.TABLE_END}\nafter\n")
    bench.update_readme(bench.committed_reports(), readme)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "old" not in text and "| `lsh` |" in text
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        bench.update_readme(bench.committed_reports(), readme)


@pytest.mark.parametrize("extra", [["--tiny"], ["--device", "cuda"], ["--results", "x.json"]])
def test_readme_only_runs_nothing_else(extra):
    with pytest.raises(ValueError, match="--readme_only"):
        bench.main(["--readme_only", *extra])
