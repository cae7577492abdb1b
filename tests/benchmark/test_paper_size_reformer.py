"""benchmarks/paper_size_reformer.py: the --tiny run trains attnzoo's Reformer, transformers' Reformer and the
checkpointed softmax model for a step each, with finite losses, and writes the JSON (every model's fit, ratios) and
plot; the models have the sizes asked for; bad flags raise ValueError naming the flag."""

from __future__ import annotations

import json
import math

import pytest

from tests.scripts_helpers import ROOT, load_module

paper = load_module(ROOT / "benchmarks", "paper_size_reformer")


def test_tiny_run_trains_all_three_models(tmp_path):
    out = tmp_path / "paper_size_reformer_cpu.json"
    paper.main(["--tiny", "--output", out])
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    environment = report["environment"]
    assert environment["device"].startswith("cpu") and environment["torch"] and environment["transformers"]
    assert environment["command"].startswith("python benchmarks/paper_size_reformer.py --tiny")
    settings = report["settings"]
    assert (settings["num_layers"], settings["hidden_size"], settings["dtype"]) == (2, 64, "float32")
    rows = {r["impl"]: r for r in report["rows"]}
    assert set(rows) == set(paper.MODELS)
    for impl, row in rows.items():
        assert row["status"] == "ok" and row["fits"] is True, (impl, row.get("error"))
        assert row["length"] == 1024 and row["step_s"] > 0 and row["tokens_per_s"] > 0
        assert row["step_peak_MiB"] is not None and row["total_peak_MiB"] > 0
        assert len(row["losses"]) == 2 and row["losses_finite"] and all(math.isfinite(x) for x in row["losses"])
        # an untrained byte-level model starts near log(256)
        assert abs(row["losses"][0] - math.log(256)) < 0.5
        assert row["activation_checkpointing"] == (impl == "softmax")
    (summary,) = report["summary"]
    assert summary["fits"] == {"attnzoo": True, "transformers": True, "softmax": True}
    assert summary["attnzoo_speedup_vs_transformers"] == pytest.approx(
        rows["transformers"]["step_s"] / rows["attnzoo"]["step_s"])
    assert summary["attnzoo_speedup_vs_softmax"] > 0


def test_models_have_matching_paper_sizes():
    sizes = dict(num_layers=2, hidden_size=64, intermediate_size=256, num_heads=4, num_hashes=2)
    ours, theirs = paper.build("attnzoo", sizes, 1024), paper.build("transformers", sizes, 1024)
    softmax = paper.build("softmax", sizes, 1024)
    assert ours.config.attn_layers == ["local", "lsh"] and ours.config.reversible
    assert theirs.config.attn_layers == ["local", "lsh"] and theirs.config.num_hashes == 2
    assert list(ours.config.axial_pos_shape) == list(theirs.config.axial_pos_shape) == [32, 32]
    assert list(ours.config.axial_pos_embds_dim) == list(theirs.config.axial_pos_embds_dim) == [16, 48]
    for config in (ours.config, softmax.config):
        assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 256)
    assert (theirs.config.feed_forward_size, theirs.config.lsh_attn_chunk_length) == (256, 64)
    assert paper.axial_dims(1024) == [256, 768]


@pytest.mark.parametrize("argv, flag", [
    (["--lengths", "1000"], "--lengths"),
    (["--lengths", "65536", "3072"], "--lengths"),
    (["--dtype", "float16"], "--dtype"),
    (["--device", "cuda:1"], "--device"),
    (["--models", "attnzoo", "longformer"], "--models"),
    (["--repeats", "0"], "--repeats"),
    (["--num_heads", "7"], "--hidden_size"),
])
def test_bad_arguments_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        paper.parse_args(argv)
