"""benchmarks/llama_uptraining.py's report: the README's table is rendered from the committed results file (so no
figure is typed by hand) and the rewrite touches nothing but the table."""

from __future__ import annotations

import json

import pytest

from tests.scripts_helpers import ROOT, load_module

bench = load_module(ROOT / "benchmarks", "llama_uptraining")
RESULTS = ROOT / "benchmarks" / "results" / "llama_uptraining.json"


def fake_report():
    stage = {"converted": 2.5, "transferred": 2.0, "finetuned": 1.6}
    kl = {"converted": 0.9, "transferred": 0.5, "finetuned": 0.1}
    return {"setup": {"scratch_steps": 1850, "source_steps": 1500}, "summary": {"source_bits_per_dim": 1.49},
            "conversions": {
                "performer": {"family": "performer", "bits_per_dim": stage, "scratch_bits_per_dim": 1.7,
                              "kl_from_source_bits_per_token": kl},
                "ra": {"family": "ra", "bits_per_dim": {k: v for k, v in stage.items() if k != "transferred"},
                       "scratch_bits_per_dim": 1.8, "kl_from_source_bits_per_token": kl}}}


def test_table_rows_and_nothing_to_learn_cells():
    table = bench.results_table(fake_report()).splitlines()
    assert table[2] == "| performer (`--family performer`) | 2.500 | 2.000 | 1.600 | 1.700 | 0.900 → 0.100 |"
    assert table[3] == "| ra (`--family ra`) | 2.500 | (nothing to learn) | 1.600 | 1.800 | 0.900 → 0.100 |"
    assert table[-1].startswith("| source: Llama, 1500 steps | 1.490 |")


def test_readme_rewrite_replaces_only_the_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{bench.TABLE_START}\nold\n{bench.TABLE_END}\nafter\n")
    bench.update_readme(fake_report(), readme)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "old" not in text
    assert bench.results_table(fake_report()) in text
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        bench.update_readme(fake_report(), readme)


def test_the_readme_shows_the_committed_results():
    report = json.loads(RESULTS.read_text())
    readme = (ROOT / "README.md").read_text()
    assert f"{bench.TABLE_START}\n{bench.results_table(report)}\n{bench.TABLE_END}" in readme
