"""benchmarks/lsh_candidate_recall.py on a tiny converted Llama with LSH far parts: the recorded candidates' log mass is
the far part's own, never above the dense far part's, and equal to it when hashing keeps every far key; each prompt's
row is kept and not measured again; bad arguments and a model without LSH are refused with nothing written."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.scripts_helpers import ROOT, load_module, save_converted_tiny_llama, save_tiny_llama

bench = load_module(ROOT / "benchmarks", "lsh_candidate_recall")
LSH = dict(attn_layers=["lsh_window"], window_size=32, num_sink_tokens=4, sink_positions="adjacent",
           far_positions=["fixed"], lsh_shared_qk=False, lsh_chunk_length=8, lsh_num_chunks_before=2,
           lsh_num_buckets=8, lsh_num_hashes=2)


def converted(folder, **settings):
    return save_converted_tiny_llama(folder, {**LSH, **settings}, "lsh")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return converted(tmp_path_factory.mktemp("tiny"))


def record_of(folder, key_line=range(100, 110)):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 256, (1, 203), generator=torch.Generator().manual_seed(0))
    record = []
    with torch.inference_mode(), bench.recorded_heads(model, torch.tensor(list(key_line)), record):
        model(ids)
    return record


def test_candidates_never_hold_more_than_every_far_key_and_the_key_line_is_theirs(model_dir):
    record = record_of(model_dir)
    assert [(layer, head) for layer, head, *_ in record] == [(i, h) for i in range(2) for h in range(4)]
    for _, _, candidates, every, line, rank in record:
        assert candidates <= every + 1e-5 and line <= every + 1e-5
        assert 0 <= rank <= 203 - 32 - 4
    # few buckets and rounds: some heads' candidates miss far mass
    assert any(candidates < every - 0.1 for _, _, candidates, every, *_ in record)


def test_hashing_that_keeps_every_far_key_holds_the_dense_far_mass(tmp_path):
    # two buckets, many rounds and a reach past the prompt: every far key is a candidate in some round
    record = record_of(converted(tmp_path, lsh_num_buckets=2, lsh_num_hashes=24, lsh_num_chunks_before=32))
    for _, _, candidates, every, *_ in record:
        assert candidates == pytest.approx(every, abs=1e-4)


def test_a_head_short_of_the_key_line_is_counted():
    heads = [{"candidates": -1.0, "all_far": 0.0, "key_line": -0.1, "key_rank": 0},  # reads it, lost it
             {"candidates": 0.0, "all_far": 0.0, "key_line": -0.1, "key_rank": 0},  # reads it, holds it all
             {"candidates": -5.0, "all_far": 0.0, "key_line": -3.0, "key_rank": 9}]  # does not read it, short
    entry = bench.head_summary(heads)
    assert entry["far_query_heads"] == 3 and entry["reading_heads"] == 2 and entry["reading_heads_short"] == 1
    assert entry["heads_short"] == 2 and entry["reading_heads_holding_share"] == 0.5
    assert entry["far_mass_held_reading"] == pytest.approx((math.exp(-1.0) + 1.0) / 2)
    assert entry["far_mass_held"] == pytest.approx((math.exp(-1.0) + 1.0 + math.exp(-5.0)) / 3)
    line = [math.exp(-0.1), math.exp(-0.1), math.exp(-3.0)]
    assert entry["key_line_mass_in_short_heads"] == pytest.approx((line[0] + line[2]) / sum(line))


def test_prompts_are_measured_once_and_summarised(tmp_path, model_dir):
    args = ["--model", str(model_dir), "--results", str(tmp_path / "lcr.json"), "--lengths", "300",
            "--depths", "0.25", "0.5", "--threads", "1"]
    report = bench.main(args)
    assert [(r["length"], r["depth"], r["trial"]) for r in report["rows"]] == [(300, 0.25, 0), (300, 0.5, 0)]
    for row in report["rows"]:
        assert len(row["heads"]) == 8 and row["passkey"].isdigit()
    entry = report["summary"]["300"]
    assert entry["prompts"] == 2 and entry["far_query_heads"] == 16
    assert entry == {**bench.head_summary([h for r in report["rows"] for h in r["heads"]]), "prompts": 2,
                     "first_answer_tokens": [r["first_answer_token"] for r in report["rows"]]}
    assert (tmp_path / "lcr.png").stat().st_size > 0
    assert json.loads((tmp_path / "lcr.json").read_text())["rows"] == report["rows"]
    again = bench.main([*args, "--depths", "0.25", "0.5", "1"])
    assert again["rows"][:2] == report["rows"] and len(again["rows"]) == 3


@pytest.mark.parametrize("flag, value", [("--depths", "2"), ("--trials", "0"), ("--lengths", "8"),
                                         ("--threads", "0")])
def test_bad_arguments_name_the_argument(tmp_path, model_dir, flag, value):
    with pytest.raises(ValueError, match=flag):
        bench.main(["--model", str(model_dir), "--results", str(tmp_path / "lcr.json"), flag, value])
    assert not (tmp_path / "lcr.json").exists()


def test_prompts_with_no_far_key_are_refused(tmp_path):
    folder = converted(tmp_path, window_size=96)  # with 4 sinks: a query's far keys begin 100 tokens back
    with pytest.raises(ValueError, match=r"--lengths \[300, 100\]: .* span 100 tokens.*no far key"):
        bench.main(["--model", str(folder), "--results", str(tmp_path / "lcr.json"), "--lengths", "300", "100"])
    assert not (tmp_path / "lcr.json").exists()


def test_a_model_without_lsh_is_refused(tmp_path):
    source = save_tiny_llama(tmp_path / "llama", layers=1)
    with pytest.raises(ValueError, match="--model: it has no LSH far part"):
        bench.main(["--model", str(source), "--results", str(tmp_path / "lcr.json"), "--lengths", "300",
                    "--depths", "0.5", "--threads", "1"])
    assert not (tmp_path / "lcr.json").exists()
