"""benchmarks/conversion_recovery.py: the recovery ratios, the equal-memory comparison with the window baseline, the
decoding-state measurement, and the README table rendered from the committed results file (no figure typed by hand);
a tiny end-to-end run (slow) goes through every stage on real checkpoints."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo import ZooHybridConfig
from tests.scripts_helpers import ROOT, in_process, load_module

bench = load_module(ROOT / "benchmarks", "conversion_recovery")
uptraining = importlib.import_module("uptraining")  # the module whose `run` runs the benchmark's commands
RESULTS = ROOT / "benchmarks" / "results" / "conversion_recovery.json"
SOURCE_LM_EVAL = {"endings/acc_norm": 0.5, "next_word/exact_match": 0.4, "perplexity/bits_per_byte": 2.0}


def model_entry(bits, lm_eval, passkey, state_short, state_long, **extra):
    return {"bits_per_dim": bits, "lm_eval": lm_eval, "passkey_accuracy": {"128": passkey[0], "512": passkey[1],
                                                                           "1024": passkey[2]},
            "decode_state_bytes": {"128": state_short, "1024": state_long}, **extra}


def fake_report():
    return {
        "setup": {"block_size": 128, "length_multiples": [1, 4, 8], "source_steps": 1500},
        "source": model_entry(1.5, SOURCE_LM_EVAL, (1.0, 0.0, 0.0), 1000, 8000),
        "baselines": {
            "window_16_4_sinks": model_entry(2.0, {**SOURCE_LM_EVAL, "endings/acc_norm": 0.3}, (0.2, 0.0, 0.0),
                                             200, 200, window_size=16, sinks=4),
            "window_64_4_sinks": model_entry(1.6, {**SOURCE_LM_EVAL, "endings/acc_norm": 0.45}, (0.6, 0.1, 0.0),
                                             700, 700, window_size=64, sinks=4)},
        "conversions": {
            # a bounded state between the two windows: compared with the 64-token window
            "favor_window": model_entry(1.55, {**SOURCE_LM_EVAL, "endings/acc_norm": 0.5}, (0.9, 0.95, 0.5),
                                        600, 600, train_tokens=1000, train_seconds=2.0),
            # a KV cache larger than every window at 1024 tokens: only the source spends as much
            "ra": model_entry(1.7, {**SOURCE_LM_EVAL, "perplexity/bits_per_byte": 2.5}, (0.5, 0.0, 0.0), 1000,
                              9000, train_tokens=1000, train_seconds=3.0)}}


def test_recovery_ratios_invert_lower_is_better_metrics():
    ratios = bench.recovery({**SOURCE_LM_EVAL, "endings/acc_norm": 0.25, "perplexity/bits_per_byte": 4.0},
                            SOURCE_LM_EVAL)
    assert ratios == {"endings/acc_norm": 0.5, "next_word/exact_match": 1.0, "perplexity/bits_per_byte": 0.5,
                      "average": pytest.approx(2 / 3), "undefined": []}
    # a figure the source scores 0 on has no ratio: it leaves the average
    ratios = bench.recovery({**SOURCE_LM_EVAL, "next_word/exact_match": 0.1},
                            {**SOURCE_LM_EVAL, "next_word/exact_match": 0.0})
    assert ratios == {"endings/acc_norm": 1.0, "perplexity/bits_per_byte": 1.0, "average": 1.0,
                      "undefined": ["next_word/exact_match"]}


def test_equal_memory_comparison_and_goals():
    summary = bench.summarize(fake_report())
    rows = summary["rows"]
    assert rows["favor_window"]["equal_memory_baseline"] == "window_64_4_sinks"
    assert rows["favor_window"]["beats_equal_memory_baseline"] == {"bits_per_dim": True, "lm_eval_recovery": True,
                                                                  "passkey_at_4x": True}
    assert rows["ra"]["equal_memory_baseline"] == "source" and rows["ra"]["decode_state_grows"]
    assert rows["ra"]["beats_equal_memory_baseline"] == {"bits_per_dim": False, "lm_eval_recovery": False,
                                                        "passkey_at_4x": False}
    assert not rows["favor_window"]["decode_state_grows"]
    assert rows["favor_window"]["decode_state_bytes_per_token"] == {"128": 600 / 128, "1024": 600 / 1024}
    assert summary["goal_every_conversion_beats_the_equal_memory_baseline"] is False
    assert summary["goal_passkey_90_percent_at_4x"] == {"favor_window": 0.95} and summary["goal_passkey_length"] == 512
    assert "train_tokens" not in rows["window_16_4_sinks"]


def test_table_is_rendered_from_the_report():
    report = fake_report()
    report["summary"] = bench.summarize(report)
    table = bench.results_table(report).splitlines()
    assert table[0].startswith("| model | bits/dim (ratio) | lm-eval recovery | passkey 1x | passkey 4x | passkey 8x |")
    assert table[2] == "| source: Llama, 1500 steps | 1.500 | 1.000 | 100% | 0% | 0% | 8 | |"
    assert table[3] == ("| favor_window | 1.550 (0.97) | 1.000 | 90% | 95% | 50% | 1 | window_64_4_sinks: yes, yes, "
                        "yes |")
    assert table[-1].startswith("| window_64_4_sinks | 1.600 (0.94) |") and table[-1].endswith("| 1 |  |")


def test_readme_rewrite_replaces_only_the_table(tmp_path):
    report = fake_report()
    report["summary"] = bench.summarize(report)
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{bench.TABLE_START}\nold\n{bench.TABLE_END}\nafter\n")
    bench.update_readme(report, readme)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "old" not in text
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        bench.update_readme(report, readme)


def test_decode_state_is_measured_from_the_cache(tmp_path):
    """A window-with-sinks model's state is S + W tokens at any length; a softmax KV cache grows with the context."""
    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=37, num_hidden_layers=2,
                  intermediate_size=48, is_decoder=True, position_embedding_type="rotary", window_size=8,
                  num_sink_tokens=2)
    for name, kind in (("window", "window"), ("full", "full")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(ZooHybridConfig(attn_layers=[kind], **common)).save_pretrained(
            tmp_path / name)
    window = bench.decode_state_bytes(tmp_path / "window", [16, 64], seed=0)
    full = bench.decode_state_bytes(tmp_path / "full", [16, 64], seed=0)
    per_token = 2 * 2 * 8 * 4  # key and value, 2 key/value heads of 8 dimensions, float32
    assert full == {"16": 2 * 16 * per_token, "64": 2 * 64 * per_token}  # two layers
    assert window["16"] == window["64"] >= 2 * (8 + 2) * per_token


@pytest.mark.parametrize("flag, value", [("--source_steps", "0"), ("--baseline_windows", "0"),
                                         ("--passkey_fraction", "1.0"), ("--length_multiples", "0")])
def test_bad_arguments_say_what_to_change(flag, value):
    with pytest.raises(ValueError, match=flag):
        bench.main([flag, value])


def test_the_readme_shows_the_committed_results():
    report = json.loads(RESULTS.read_text())
    readme = (ROOT / "README.md").read_text()
    assert f"{bench.TABLE_START}\n{bench.results_table(report)}\n{bench.TABLE_END}" in readme


@pytest.mark.slow
def test_tiny_end_to_end_run(tmp_path, monkeypatch):
    """Every stage on real checkpoints, tiny: source with passkey data, a baseline window, one windowed conversion
    with attention transfer, its evaluations, the JSON, the plot and the model card's figures. The benchmark's
    commands (training, conversion, transfer, evaluation, passkey retrieval), recorded as it records them, run in
    this process."""
    monkeypatch.setattr(uptraining, "run", in_process(uptraining.run))
    monkeypatch.setattr(bench, "run", uptraining.run)
    results = tmp_path / "recovery.json"
    report = bench.main(["--conversions", "favor_window", "--baseline_windows", "8", "--source_steps", "3",
                         "--transfer_steps", "2", "--finetune_steps", "2", "--batch", "2", "--hidden", "32",
                         "--layers", "2", "--heads", "4", "--kv_heads", "2", "--eval_every", "2",
                         "--length_multiples", "1", "2", "--passkey_depths", "0", "1", "--passkey_trials", "1",
                         "--lm_eval_limit", "3", "--output_dir", str(tmp_path / "runs"), "--results", str(results)])
    assert json.loads(results.read_text()) == report and results.with_suffix(".png").stat().st_size > 0
    row = report["summary"]["rows"]["favor_window"]
    assert row["equal_memory_baseline"] in ("window_8_4_sinks", "source")
    assert set(row["passkey_accuracy"]) == {"128", "256"} and row["train_tokens"] == 4 * 2 * 128
    assert report["conversions"]["favor_window"]["transferred"]
    assert not row["decode_state_grows"] and not report["summary"]["rows"]["window_8_4_sinks"]["decode_state_grows"]
    card = (tmp_path / "runs" / "favor_window_finetuned" / "README.md").read_text()
    assert "## Passkey retrieval" in card and "## lm-evaluation-harness" in card
