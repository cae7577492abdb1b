"""benchmarks/lsh_decoding_state.py: a one-layer run measures every LSH design's decoding cache against the source's
KV cache in the same run (workers run in this process here), keeps its rows, reruns only missing ones, and refuses
bad sizes by flag."""

from __future__ import annotations

import json

import pytest

from tests.benchmark.workers import workers_in_process
from tests.scripts_helpers import ROOT, load_module

bench = load_module(ROOT / "benchmarks", "lsh_decoding_state")
TINY = ["--layers", "1", "--lengths", "128", "--threads", "1", "--decode_steps", "2"]


@pytest.fixture
def in_process(monkeypatch):
    yield from workers_in_process(bench, monkeypatch)


def test_a_tiny_run_compares_each_cache_with_the_kv_cache_and_keeps_its_rows(tmp_path, in_process):
    results = tmp_path / "state.json"
    bench.main([*TINY, "--results", str(results)])
    report = json.loads(results.read_text())
    assert results.with_suffix(".png").stat().st_size > 0
    assert {(r["shape"], r["model"]) for r in report["rows"]} == {(s, m) for s in bench.SHAPES for m in bench.MODELS}
    rows = {(r["shape"], r["model"]): r for r in report["rows"]}
    head_bytes = 128 * 64 * 4  # one head's keys (or values) of 128 float32 tokens
    assert rows["gqa", "source"]["cache_bytes"] == 2 * 3 * head_bytes  # transformers' cache: keys and values, 3 heads
    assert rows["mha", "source"]["cache_bytes"] == 2 * 9 * head_bytes
    summary = report["summary"]
    for shape, model in bench.GOAL_APPLIES:
        # a KV cache plus the bucket index: a 2-byte position per key, head and round (2.3% of the KV cache with 9
        # query heads on 3 key heads), and where each of the 512 buckets' runs starts (2 bytes a bucket, head and
        # round whatever the length: 9.4% of a 128-token KV cache, 1.2% at the goal's shortest, 1K)
        assert 1.0 < summary[f"{shape}/{model}/128"]["state_over_kv_cache"] < 1.13
        assert summary[f"{shape}/{model}/128"]["meets_goal"] is (
            summary[f"{shape}/{model}/128"]["state_over_kv_cache_after_decode"] <= bench.GOAL)
    # shared QK under grouped heads: 9 query-keys and 3 values against 3 keys and 3 values
    assert summary["gqa/lsh/128"]["state_over_kv_cache"] == pytest.approx(2.0, abs=0.03)
    assert "goal" not in summary["gqa/lsh/128"]

    in_process.clear()
    bench.main([*TINY, "--results", str(results)])
    assert in_process == []
    bench.main([*TINY, "--results", str(results), "--models", "source", "--shapes", "mha", "--remeasure"])
    assert [(job["shape"], job["model"]) for job in in_process] == [("mha", "source")]


@pytest.mark.parametrize("flag, value", [("--lengths", "32"), ("--threads", "0"), ("--layers", "0"),
                                         ("--decode_steps", "-1")])
def test_bad_sizes_name_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit):
        bench.main([flag, value])
    assert flag in capsys.readouterr().err
