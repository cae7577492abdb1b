"""benchmarks/near_part_speed.py: a one-layer run times every design against transformers' SDPA Llama in the same
run (workers run in this process here), keeps each row as it is measured, reruns only missing rows, and writes its
JSON, plot and README table from its own report only; bad sizes name the flag."""

from __future__ import annotations

import json

import pytest

from tests.benchmark.workers import workers_in_process
from tests.scripts_helpers import ROOT, load_module

bench = load_module(ROOT / "benchmarks", "near_part_speed")
TINY = ["--layers", "1", "--lengths", "128", "--dtypes", "float32", "--threads", "1", "--decode_steps", "2"]


@pytest.fixture
def in_process(monkeypatch):
    yield from workers_in_process(bench, monkeypatch)


def test_a_tiny_run_measures_each_design_against_the_source_and_keeps_its_rows(tmp_path, in_process, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{bench.MARKERS[0]}\nold\n{bench.MARKERS[1]}\nafter\n")
    monkeypatch.setattr(bench, "README", readme)
    results = tmp_path / "speed.json"
    bench.main([*TINY, "--results", str(results)])
    report = json.loads(results.read_text())
    assert results.with_suffix(".png").stat().st_size > 0
    assert {(r["model"], r["length"]) for r in report["rows"]} == {(m, 128) for m in bench.MODELS}
    for row in report["rows"]:
        assert row["prefill_s"] > 0 and row["cache_mib"] > 0 and row["decode_tokens_per_s"] > 0
    source = next(r for r in report["rows"] if r["model"] == "source")
    for model in bench.DESIGNS:
        row = next(r for r in report["rows"] if r["model"] == model)
        entry = report["summary"][f"{model}/float32/128"]
        assert entry["forward_time_over_source"] == pytest.approx(row["prefill_s"] / source["prefill_s"])
        assert entry["state_over_kv_cache"] == pytest.approx(row["cache_mib"] / source["cache_mib"])
    # the window's decoding ring holds W + sinks = 1028 slots from the start (a flat state): 1028/128 of the KV cache
    assert report["summary"]["window/float32/128"]["state_over_kv_cache"] == pytest.approx(1028 / 128, rel=0.01)
    assert readme.read_text().count("old") == 1  # not the committed report: the README is left alone

    # the same setup again measures nothing; --remeasure measures every row
    in_process.clear()
    bench.main([*TINY, "--results", str(results)])
    assert in_process == []
    bench.main([*TINY, "--results", str(results), "--models", "source", "--remeasure"])
    assert [job["model"] for job in in_process] == ["source"]
    assert len(json.loads(results.read_text())["rows"]) == len(bench.MODELS)


def test_the_readme_table_comes_from_the_committed_report(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"{bench.MARKERS[0]}\n{bench.MARKERS[1]}\n")
    monkeypatch.setattr(bench, "README", readme)
    bench.main(["--readme_only"])
    table = bench.table(json.loads(bench.COMMITTED.read_text()))
    assert table in readme.read_text() and table in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("flag, value", [("--lengths", "64"), ("--threads", "0"), ("--decode_steps", "-1")])
def test_bad_sizes_name_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit):
        bench.main([flag, value])
    assert flag in capsys.readouterr().err


def test_readme_only_names_a_bad_results_file(tmp_path):
    bad = tmp_path / "mine.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="mine.json"):
        bench.main(["--readme_only", "--results", str(bad)])


@pytest.mark.parametrize("device, message", [("tpu", "use cpu, cuda or cuda:N"),
                                             ("cuda", "no such CUDA device is visible here; use --device cpu"),
                                             ("cuda:", "use cpu, cuda or cuda:N")])
def test_a_bad_device_names_the_flag(device, message, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--device", device, "--lengths", "128"])
    err = capsys.readouterr().err
    assert f"--device {device}" in err and message in err


def test_a_gpu_run_is_its_own_report_with_the_device_in_every_job_and_no_cpu_goals(tmp_path, monkeypatch):
    """On a GPU (issue 48's `near` stage of benchmarks/gpu_session.sh) every worker gets the device, the report's
    setup and environment name the GPU, the CPU goals are not judged, and the README is left alone. The workers are
    stand-ins here: this machine has no GPU to measure on."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench, "cuda_device_name", lambda device: "NVIDIA H200")
    readme = tmp_path / "README.md"
    readme.write_text(f"{bench.MARKERS[0]}\nold\n{bench.MARKERS[1]}\n")
    monkeypatch.setattr(bench, "README", readme)
    jobs = []

    def worker(script, args):
        job = json.loads(args[0])
        jobs.append(job)
        seconds = {"source": 2.0, "window": 1.0, "lsh_window": 1.5}[job["model"]]
        return {"prefill_s": seconds, "tokens_per_s_prefill": job["length"] / seconds, "peak_growth_mib": 1.0,
                "cache_mib": 1.0, **({"decode_tokens_per_s": 10.0 / seconds} if job["decode_steps"] else {})}

    monkeypatch.setattr(bench, "run_worker", worker)
    results = tmp_path / "near_part_speed_cuda.json"
    bench.main(["--device", "cuda", "--dtypes", "float32", "--lengths", "8192", "32768", "--results", str(results)])
    assert {job["device"] for job in jobs} == {"cuda"} and len(jobs) == 2 * len(bench.MODELS)
    report = json.loads(results.read_text())
    assert report["setup"]["device"] == "NVIDIA H200" and report["environment"]["device"] == "NVIDIA H200"
    entry = report["summary"]["window/float32/32768"]
    assert entry["forward_time_over_source"] == pytest.approx(0.5) and "meets_forward_goal" not in entry
    assert entry["decode_speedup"] == pytest.approx(2.0)
    assert readme.read_text().count("old") == 1
    assert results.with_suffix(".png").stat().st_size > 0
