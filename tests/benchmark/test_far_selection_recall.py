"""benchmarks/far_selection_recall.py on a tiny converted Llama with block retrieval: its `exact` rule selects the
blocks the far parts themselves select, every rule's count is of the far query heads, each prompt's row is kept and
not measured again, and bad arguments are refused with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.scripts_helpers import ROOT, load_module, save_converted_tiny_llama, save_tiny_llama

bench = load_module(ROOT / "benchmarks", "far_selection_recall")
BLOCKS = dict(attn_layers=["block_window"], window_size=32, num_sink_tokens=4, sink_positions="adjacent",
              far_positions=["fixed"], block_size=8, block_topk=3, block_query_size=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_converted_tiny_llama(tmp_path_factory.mktemp("tiny"), BLOCKS, "block")


def test_the_exact_rule_is_the_far_parts_own_selection(model_dir):
    from attnzoo.transformers_compat import output_cache

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(0, 256, (1, 203), generator=torch.Generator().manual_seed(0))
    record = []
    with torch.inference_mode(), bench.recorded_selections(model, record):
        cache = output_cache(model(ids, use_cache=True))
    assert len(record) == 2
    for layer, (sigma, keys) in enumerate(record):
        selected = cache.layers[layer].state["far.block_selection"][0]  # [H, k]: the last query block's choice
        assert sigma.shape == (4, 8) and keys.shape[:2] == (4, (200 - 32 - 4 + 1) // 8)
        chosen = bench.top_by_rule(sigma, keys, 3, "exact", torch.Generator())
        assert [set(row) for row in chosen.tolist()] == [set(row) for row in selected.tolist()]


def test_prompts_are_measured_once_and_summarised(tmp_path, model_dir):
    args = ["--model", str(model_dir), "--results", str(tmp_path / "fsr.json"), "--lengths", "300",
            "--depths", "0.25", "0.5", "--hashings", "4x8", "--threads", "1"]
    report = bench.main(args)
    rules = bench.rule_names(["4x8"])
    assert rules == ["exact", "cosine", "cosine_centred", "lsh_4x8_raw", "lsh_4x8_centred", "lsh_4x8_mips"]
    assert [(r["length"], r["depth"], r["trial"]) for r in report["rows"]] == [(300, 0.25, 0), (300, 0.5, 0)]
    for row in report["rows"]:
        assert row["heads"] == 8 and set(row["found"]) == set(rules)
        assert all(0 <= count <= 8 for count in row["found"].values())
    entry = report["summary"]["300"]
    assert entry["far_query_heads"] == 16
    assert entry["found_share"]["exact"] == sum(r["found"]["exact"] for r in report["rows"]) / 16
    assert (tmp_path / "fsr.png").stat().st_size > 0
    saved = json.loads((tmp_path / "fsr.json").read_text())
    assert saved["rows"] == report["rows"]
    # a rerun of the same setup measures nothing again; a new depth only its own prompt
    again = bench.main([*args, "--depths", "0.25", "0.5", "1"])
    assert again["rows"][:2] == report["rows"] and len(again["rows"]) == 3


@pytest.mark.parametrize("flag, value", [("--hashings", "5x8"), ("--hashings", "sixteen"), ("--depths", "2"),
                                         ("--trials", "0"), ("--lengths", "8")])
def test_bad_arguments_name_the_argument(tmp_path, model_dir, flag, value):
    with pytest.raises(ValueError, match=flag):
        bench.main(["--model", str(model_dir), "--results", str(tmp_path / "fsr.json"), flag, value])
    assert not (tmp_path / "fsr.json").exists()


def test_a_model_without_block_retrieval_is_refused(tmp_path):
    from attnzoo.convert.llama import convert

    source = save_tiny_llama(tmp_path / "llama", layers=1)
    window = tmp_path / "window"
    convert(AutoModelForCausalLM.from_pretrained(source), "hybrid",
            dict(BLOCKS, attn_layers=["lsh_window"], lsh_shared_qk=False)).save_pretrained(window)
    AutoTokenizer.from_pretrained(source).save_pretrained(window)
    with pytest.raises(ValueError, match="--model"):
        bench.main(["--model", str(window), "--results", str(tmp_path / "fsr.json"), "--lengths", "300"])
    assert not (tmp_path / "fsr.json").exists()
