"""benchmarks/decoding_speed.py: the --tiny sweep runs every decoder family and both static-cache baselines, decodes
through the real cached path (its tokens equal the full forward's greedy argmax), and writes the JSON and plot; the
ratios are computed from the rows; bad flags raise ValueError naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.scripts_helpers import ROOT, load_module

decoding = load_module(ROOT / "benchmarks", "decoding_speed")

#: The sweep's worker as harness.run_worker starts it (`python benchmarks/decoding_speed.py --worker JOBS`, a process
#: of its own that prints its JSON result last), with the objects of the libraries it imports first moved out of the
#: garbage collector's reach (gc.freeze) before the script runs. measure() calls gc.collect() four times a
#: configuration, and each call would walk the ~400,000 objects of torch, transformers and attnzoo: half a second on
#: two cores, some 90 of the tiny sweep's 130 seconds. The worker runs the same code on the same jobs.
FROZEN_IMPORTS_WORKER = """
import gc, os, runpy, sys
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))
import torch, transformers, attnzoo
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, StaticCache
gc.collect()
gc.freeze()
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def run_worker_with_frozen_imports(script: str, args: list[str]) -> dict | None:
    """harness.run_worker, its worker started by FROZEN_IMPORTS_WORKER."""
    done = subprocess.run([sys.executable, "-c", FROZEN_IMPORTS_WORKER, script, "--worker", *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"worker {args} failed:\n{done.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


decoding.run_worker = run_worker_with_frozen_imports  # this test module's own copy of the benchmark


def decoding_owned():
    """benchmarks/owned_outputs.py as decoding_speed.py imported it (its Refused)."""
    import owned_outputs

    return owned_outputs


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("decoding") / "decoding_speed_cpu.json"
    decoding.main(["--tiny", "--output", out])
    return json.loads(out.read_text()), out


def test_tiny_run_measures_every_family_on_its_cached_path(tiny_report):
    report, out = tiny_report
    assert out.with_suffix(".png").stat().st_size > 0
    environment = report["environment"]
    assert environment["device"].startswith("cpu") and environment["torch"] and environment["transformers"]
    assert environment["command"].startswith("python benchmarks/decoding_speed.py --tiny")
    baseline = report["baseline"]
    assert baseline["note"] and baseline["impl"] in ("softmax", "softmax_static")
    assert (baseline["impl"] == "softmax_static") == baseline["static_cache_usable_by_attnzoo_softmax"]
    impls = {*decoding.DEFAULT_FAMILIES, baseline["impl"], "gpt2_static"}
    assert set(report["models"]) == impls
    rows = {(r["impl"], r["batch"], r["context"]): r for r in report["rows"]}
    expected = {(impl, batch, context) for impl in impls for batch in (1, 2) for context in (64, 128)}
    assert set(rows) == expected
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row.get("error"))
        assert row["prefill_s"] > 0 and row["ms_per_token"] > 0 and len(row["ms_per_token_all"]) == 3
        assert row["decode_peak_MiB"] is not None and row["cache_MiB"] is not None
        # the prefill's token and two cached steps', for every row of the batch, as the full forward predicts them
        assert len(row["decoded_tokens"]) == key[1] and all(len(t) == 3 for t in row["decoded_tokens"])
        assert row["matches_full_forward"], (key, row["decoded_tokens"], row["full_forward_tokens"])
        assert row["max_abs_logit_difference"] < 1e-4
    # the decoding state's exact bytes: bounded states stay the same size, a KV cache grows with the context
    for impl in ("performer", "window", "favor_window"):
        assert rows[(impl, 1, 64)]["state_bytes"] == rows[(impl, 1, 128)]["state_bytes"] > 0, impl
    for impl in ("softmax", "ra_window", "lara_window", "lsh_window"):
        assert rows[(impl, 1, 128)]["state_bytes"] > rows[(impl, 1, 64)]["state_bytes"] > 0, impl
    assert rows[("gpt2_static", 1, 64)]["cache_class"] == "StaticCache[StaticLayer]"
    assert rows[("performer", 1, 64)]["cache_class"] == "ZooCache[RecurrentStateLayer]"


def test_tiny_run_reports_ratios_against_the_baseline_for_every_family(tiny_report):
    report, _ = tiny_report
    summary = report["summary"]
    assert not summary["not_run"]
    ratios = {(r["family"], r["batch"], r["context"]): r for r in summary["vs_baseline"]}
    families = set(report["models"]) - {"gpt2_static", "softmax_static"}
    assert set(ratios) == {(f, b, c) for f in families for b in (1, 2) for c in (64, 128)}
    rows = {(r["impl"], r["batch"], r["context"]): r for r in report["rows"]}
    base = report["baseline"]["impl"]
    for (family, batch, context), ratio in ratios.items():
        expected = rows[(base, batch, context)]["ms_per_token"] / rows[(family, batch, context)]["ms_per_token"]
        assert ratio["speedup_vs_baseline"] == pytest.approx(expected)
        assert ratio["speedup_vs_gpt2_static"] > 0
    flat = {(r["impl"], r["batch"]): r for r in summary["flat_in_context"]}
    assert {(f, b) for f in families for b in (1, 2)} <= set(flat)
    assert all(r["shortest_context"] == 64 and r["longest_context"] == 128 for r in flat.values())


def test_merge_adds_a_second_run_to_the_first(tiny_report, tmp_path):
    first, out = tiny_report
    copy = tmp_path / "decoding_speed_cpu.json"
    copy.write_text(out.read_text())
    decoding.main(["--tiny", "--merge", "--families", "performer", "--batch_sizes", "1", "--contexts", "64",
                   "--skip_transformers_static", "--output", copy])
    report = json.loads(copy.read_text())
    assert len(report["environment"]["commands"]) == 2 and "--merge" in report["environment"]["commands"][1]
    assert len(report["rows"]) == len(first["rows"]) and set(report["models"]) == set(first["models"])
    keys = [(r["impl"], r["batch"], r["context"]) for r in report["rows"]]
    assert len(set(keys)) == len(keys) and keys[-1] == ("performer", 1, 64)
    with pytest.raises(ValueError, match="--merge: .* other settings"):
        decoding.main(["--tiny", "--merge", "--new_tokens", "4", "--output", copy])


def test_compiled_static_run_decodes_every_family_from_its_static_cache(tmp_path):
    """--compiled_static: each family's decode step compiled once over its static cache (dynamo's 'eager' backend
    here, for seconds) decodes the full forward's tokens; an attention without a static slot is recorded as such."""
    out = tmp_path / "decoding_speed_cpu_compiled.json"
    decoding.main(["--tiny", "--compiled_static", "--compile_backend", "eager", "--warmup_tokens", "2",
                   "--batch_sizes", "2", "--contexts", "64", "--families", "performer", "reformer", "lara", "ra",
                   "window", "--skip_transformers_static", "--output", out])
    report = json.loads(out.read_text())
    assert report["settings"]["decode_step"] == "compiled (eager), static cache"
    rows = {r["impl"]: r for r in report["rows"]}
    for impl in ("performer", "reformer", "lara", "ra", report["baseline"]["impl"]):
        assert rows[impl]["status"] == "ok", rows[impl].get("error")
        assert rows[impl]["matches_full_forward"] and rows[impl]["warmup_s"] > 0
    assert rows["performer"]["cache_class"] == "ZooCache[StaticRecurrentStateLayer]"
    assert rows["reformer"]["cache_class"] == "ZooCache[StaticTokenBufferLayer]"
    assert rows["window"]["status"] == "no_static_cache" and "'window'" in rows["window"]["error"]


def test_the_static_cache_probe_matches_what_attnzoo_softmax_does():
    usable, note = decoding.static_cache_probe(decoding.settings_of(decoding.parse_args(["--tiny"])))
    assert isinstance(usable, bool) and "StaticCache" in note


def test_summary_skips_missing_rows_and_merge_replaces_re_run_ones(tmp_path):
    row = dict(status="ok", decode_peak_MiB=10.0)
    rows = [dict(row, impl="softmax", batch=1, context=1024, ms_per_token=4.0),
            dict(row, impl="performer", batch=1, context=1024, ms_per_token=2.0),
            dict(row, impl="performer", batch=1, context=4096, ms_per_token=3.0),
            dict(impl="softmax", batch=1, context=4096, status="oom", error="OutOfMemoryError: ...")]
    summary = decoding.summarise(rows, ["softmax", "performer"], "softmax")
    by = {(r["family"], r["context"]): r for r in summary["vs_baseline"]}
    assert by[("performer", 1024)]["speedup_vs_baseline"] == 2.0
    assert by[("performer", 4096)]["speedup_vs_baseline"] is None
    assert by[("performer", 1024)]["speedup_vs_gpt2_static"] is None
    flat = {r["impl"]: r for r in summary["flat_in_context"]}
    assert flat["performer"]["longest_over_shortest"] == 1.5 and "softmax" not in flat
    assert summary["not_run"][0]["status"] == "oom"

    previous = {"settings": {"a": 1}, "baseline": {"impl": "softmax"}, "environment": {"device": "gpu"}, "rows": rows}
    merged = decoding.merged_rows(rows, [dict(row, impl="softmax", batch=1, context=4096, ms_per_token=9.0)])
    assert len(merged) == 4 and merged[-1]["ms_per_token"] == 9.0 and merged[-1]["status"] == "ok"
    now = {"settings": {"a": 1}, "baseline": {"impl": "softmax"}, "environment": {"device": "gpu"}}
    decoding.check_mergeable(previous, now, tmp_path / "x.json")
    decoding.check_mergeable(previous, dict(now, environment={"device": None}), tmp_path / "x.json")
    for other in (dict(now, environment={"device": "another gpu"}), dict(now, settings={"a": 2})):
        with pytest.raises(ValueError, match="--merge"):
            decoding.check_mergeable(previous, other, tmp_path / "x.json")


@pytest.mark.parametrize("argv, flag", [
    (["--contexts", "0"], "--contexts"),
    (["--batch_sizes", "1", "-2"], "--batch_sizes"),
    (["--families", "softmax", "linformer"], "--families"),
    (["--dtype", "float16"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--new_tokens", "0"], "--new_tokens"),
    (["--num_heads", "3"], "--num_heads"),
    (["--check_steps", "50", "--new_tokens", "4"], "--check_steps"),
    (["--merge", "--output", "/nonexistent/decoding.json"], "--merge"),
    (["--compile_backend", "eager"], "--compile_backend"),
    (["--compiled_static", "--warmup_tokens", "1"], "--warmup_tokens"),
])
def test_bad_arguments_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        decoding.parse_args(argv)


def test_the_docs_table_is_written_from_a_results_file(tiny_report, tmp_path, monkeypatch):
    """docs/benchmarks.md's decoding table comes from a results file (`--docs_only`), never typed in: the committed
    one (here the tiny report, standing in for it), and no other."""
    report, out = tiny_report
    table = decoding.decoding_table(report)
    lines = table.splitlines()
    assert lines[0].startswith("| implementation | ms/token, batch 1, 64 |")
    assert len(lines) == 2 + len(report["models"])
    row = {(r["impl"], r["batch"], r["context"]): r for r in report["rows"]}[("performer", 2, 128)]
    performer = next(line for line in lines if line.startswith("| `performer` |"))
    assert f"{row['ms_per_token']:.2f}" in performer.split(" | ")
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"before\n{decoding.TABLE_START}\nold\n{decoding.TABLE_END}\nafter\n")
    copy = tmp_path / "copy.json"
    copy.write_text(out.read_text())
    decoding.main(["--docs_only", "--output", str(copy), "--docs", str(docs)])  # not the committed report: left
    assert "\nold\n" in docs.read_text()
    monkeypatch.setattr(decoding, "RESULTS", out.parent)  # out: decoding_speed_cpu.json, the committed name
    decoding.main(["--docs_only", "--output", str(out), "--docs", str(docs)])
    assert docs.read_text() == f"before\n{decoding.TABLE_START}\n{table}\n{decoding.TABLE_END}\nafter\n"
    copy.write_text('{"my": "table"}')
    with pytest.raises(decoding_owned().Refused, match=f"--output {copy} is not a report of "):
        decoding.main(["--docs_only", "--output", str(copy), "--docs", str(docs)])
    with pytest.raises(ValueError, match="--docs_only"):
        decoding.main(["--docs_only", "--tiny"])
