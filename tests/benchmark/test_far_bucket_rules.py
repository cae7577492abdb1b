"""benchmarks/far_bucket_rules.py: each rule chooses the far keys it says (on hand-made keys), and on a tiny converted
Llama with block retrieval every head's shares are bookkept against its exact far softmax (a rule that reads every
far key holds all of it), each prompt's row is kept and not measured again, and bad arguments are refused with
nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from tests.scripts_helpers import ROOT, load_module, save_converted_tiny_llama

bench = load_module(ROOT / "benchmarks", "far_bucket_rules")
BLOCKS = dict(attn_layers=["block_window"], window_size=32, num_sink_tokens=4, sink_positions="adjacent",
              far_positions=["fixed"], block_size=8, block_topk=3, block_query_size=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_converted_tiny_llama(tmp_path_factory.mktemp("tiny"), BLOCKS, "block")


def test_most_recent_members_are_the_last_k_of_each_wanted_bucket():
    buckets = torch.tensor([0, 1, 0, 2, 0, 1, 0])
    chosen = bench.most_recent_members(buckets, torch.tensor([0, 2]), 2)
    assert chosen.tolist() == [False, False, False, True, True, False, True]


def test_each_rule_chooses_the_keys_it_says():
    # two content groups along e0 and e1, interleaved in time; the query points along e0
    keys = torch.zeros(12, 4)
    keys[0::2, 0], keys[1::2, 1] = 1.0, 1.0
    keys += 0.01 * torch.arange(12.0)[:, None] * torch.tensor([0.0, 0.0, 1.0, 0.0])
    query = torch.tensor([5.0, 0.0, 0.0, 0.0])
    centre = torch.zeros(4)
    along_e0 = torch.arange(12) % 2 == 0
    # centroid 0 sits on the e1 group, centroid 1 on the e0 group; a third far from every key stays empty
    centroids = {3: torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -9.0]])}
    generator = torch.Generator().manual_seed(0)

    def chosen(rule, recent=100):
        return bench.chosen_keys(rule, query, keys, centre, centroids, generator, 4, recent)

    assert chosen("centroids_3x1").tolist() == along_e0.tolist()
    assert chosen("centroids_3x1", recent=2).tolist() == [i in (8, 10) for i in range(12)]
    assert chosen("centroids_3x3").all()
    # probed by the fixed centroids, the empty bucket scores above the e1 group's: two probes find e0's keys only
    centroids[3][2] = torch.tensor([0.5, 0.0, 0.0, 0.0]) + torch.tensor([0.0, 0.0, 0.0, -9.0])
    assert chosen("centroids_3x2_fixed").tolist() == along_e0.tolist()
    assert chosen("centroids_3x2").all()  # member means skip the empty bucket
    # the log mass: one key scoring 2 against three scoring 1.9 (scores / √4 = 1 and 0.95): by the mean the one key's
    # bucket, by the mass the three's (0.95 + log 3 > 1 + log 1)
    few = torch.zeros(6, 4)
    few[0, 0], few[1:4, 1], few[4:, 2] = 1.0, 0.95, 1.0
    two = {3: torch.eye(4)[:3]}
    toward = torch.tensor([2.0, 2.0, -5.0, 0.0])
    assert bench.chosen_keys("centroids_3x1", toward, few, centre, two, generator, 4, 100).tolist() == [
        True] + [False] * 5
    assert bench.chosen_keys("centroids_3x1_mass", toward, few, centre, two, generator, 4, 100).tolist() == [
        False, True, True, True, False, False]
    # blocks of 4 consecutive keys: their means tie, so the top block is one whole block of 4
    block = chosen("blocks_1")
    assert block.sum() == 4 and block.view(3, 4).all(1).sum() == 1
    # keys identical to the query's direction share its bucket in every round
    same = bench.chosen_keys("rotations_8x3", query, query.repeat(5, 1), centre, centroids, generator, 4, 3)
    assert same.tolist() == [False, False, True, True, True]


def test_prompts_are_measured_once_and_every_share_is_of_the_exact_far_softmax(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(bench, "KEPT_SHARE", 0.0)  # every head kept, whatever the tiny model looks at
    rules = ["blocks_2", "rotations_4x2", "centroids_8x2", "centroids_8x2_fixed", "centroids_8x8_mass",
             "centroids_8x8"]
    args = ["--model", str(model_dir), "--results", str(tmp_path / "fbr.json"), "--lengths", "300",
            "--depths", "0.25", "0.5", "--rules", *rules, "--recent", "1000", "--calibration_length", "64",
            "--threads", "1"]
    report = bench.main(args)
    assert [(r["length"], r["depth"], r["trial"]) for r in report["rows"]] == [(300, 0.25, 0), (300, 0.5, 0)]
    for row in report["rows"]:
        assert row["far_keys"] == 300 - 1 - 32 + 1 - 4 and row["far_query_heads"] == len(row["heads"]) == 2 * 4
        for head in row["heads"]:
            assert 0 <= head["key_line_share"] <= 1 and set(head["rules"]) == set(rules)
            # probing all 8 buckets with room for every key reads every far key
            assert head["rules"]["centroids_8x8"]["keys_read"] == row["far_keys"]
            assert head["rules"]["centroids_8x8"]["key_line_held"] == pytest.approx(1.0)
            assert head["rules"]["centroids_8x8"]["far_held"] == pytest.approx(1.0, abs=1e-5)
            assert head["rules"]["blocks_2"]["keys_read"] == 2 * 8
            for held in head["rules"].values():
                assert 0 <= held["key_line_held"] <= 1 + 1e-6 and held["far_held"] <= 1 + 1e-5
    reading = [h for r in report["rows"] for h in r["heads"] if h["key_line_share"] >= 0.5]
    entry = report["summary"]["300"]
    assert entry["reading_heads"] == len(reading) and entry["prompts"] == 2 and entry["far_query_heads"] == 16
    if reading:
        assert entry["rules"]["centroids_8x8"]["heads_holding_half"] == len(reading)
    assert (tmp_path / "fbr.png").stat().st_size > 0
    assert json.loads((tmp_path / "fbr.json").read_text())["rows"] == report["rows"]
    again = bench.main([*args, "--depths", "0.25", "0.5", "1"])
    assert again["rows"][:2] == report["rows"] and len(again["rows"]) == 3


def test_the_summary_counts_the_heads_that_read_the_key_line():
    def head(share, held, read):
        return {"key_line_share": share, "rules": {"r": {"key_line_held": held, "far_held": held, "keys_read": read}}}

    rows = [{"length": 8, "far_query_heads": 5, "heads": [head(0.9, 1.0, 10), head(0.2, 0.0, 99)]},
            {"length": 8, "far_query_heads": 5, "heads": [head(0.5, 0.4, 30), head(0.7, 0.6, 20)]},
            {"length": 16, "far_query_heads": 5, "heads": [head(0.1, 1.0, 5)]}]
    summary = bench.summary(rows, ["r"])
    assert summary["8"] == {"prompts": 2, "far_query_heads": 10, "reading_heads": 3, "rules": {"r": {
        "key_line_held_mean": pytest.approx(2.0 / 3), "far_held_mean": pytest.approx(2.0 / 3), "heads_holding_half": 2,
        "keys_read_median": 20}}}
    assert summary["16"] == {"prompts": 1, "far_query_heads": 5, "reading_heads": 0, "rules": {}}


def test_a_row_keeps_the_heads_that_look_at_the_key_line(tmp_path, model_dir, monkeypatch):
    """With the threshold at 0 every far query head is in the row; with it raised, exactly those whose key-line share
    reaches it, with the same figures (every head draws its rotations either way)."""
    args = ["--model", str(model_dir), "--lengths", "300", "--depths", "0.5", "--rules", "rotations_4x2",
            "centroids_8x2", "--calibration_length", "64", "--threads", "1"]
    monkeypatch.setattr(bench, "KEPT_SHARE", 0.0)
    (every,) = bench.main([*args, "--results", str(tmp_path / "all.json")])["rows"]
    shares = sorted(h["key_line_share"] for h in every["heads"])
    monkeypatch.setattr(bench, "KEPT_SHARE", shares[len(shares) // 2])
    (some,) = bench.main([*args, "--results", str(tmp_path / "some.json")])["rows"]
    assert some["far_query_heads"] == every["far_query_heads"] == len(every["heads"])
    assert some["heads"] == [h for h in every["heads"] if h["key_line_share"] >= shares[len(shares) // 2]]
    assert 0 < len(some["heads"]) < len(every["heads"])


def test_a_report_from_before_the_filler_option_is_continued_and_another_filler_goes_beside(tmp_path, model_dir):
    args = ["--model", str(model_dir), "--results", str(tmp_path / "fbr.json"), "--lengths", "300", "--depths", "0.5",
            "--rules", "centroids_8x2", "--calibration_length", "64", "--threads", "1"]
    first = bench.main(args)
    saved = json.loads((tmp_path / "fbr.json").read_text())
    assert saved["setup"]["filler"] == "repeat"
    del saved["setup"]["filler"]  # as the reports before --filler were written
    (tmp_path / "fbr.json").write_text(json.dumps(saved))
    again = bench.main([*args, "--depths", "0.5", "1"])
    assert again["rows"][0] == first["rows"][0] and len(again["rows"]) == 2
    assert json.loads((tmp_path / "fbr.json").read_text())["setup"]["filler"] == "repeat"
    prose = bench.main([*args, "--filler", "corpus"])
    assert prose["setup"]["filler"] == "corpus" and len(prose["rows"]) == 1
    assert len(list(tmp_path.glob("fbr*.json"))) == 2 and len(json.loads((tmp_path / "fbr.json").read_text())[
        "rows"]) == 2


@pytest.mark.parametrize("flag, value", [("--filler", "lorem"), ("--rules", "rotations_5x8"),
                                         ("--rules", "centroids_8x16"), ("--rules", "blocks"),
                                         ("--rules", "sorted_4"), ("--rules", "centroids_8x2_mean"), ("--recent", "0"),
                                         ("--calibration_length", "4"), ("--depths", "2")])
def test_bad_arguments_name_the_argument(tmp_path, model_dir, flag, value):
    with pytest.raises(ValueError, match=flag):
        bench.main(["--model", str(model_dir), "--results", str(tmp_path / "fbr.json"), "--rules", "centroids_8x2",
                    flag, value])
    assert not (tmp_path / "fbr.json").exists()
