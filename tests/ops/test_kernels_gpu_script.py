"""benchmarks/kernels_gpu.py is GPU-only; here only its code paths run: the refusal without CUDA, argument parsing,
and the ratio/summary/plot code on a made-up result written to a temporary folder (not a measurement, never
committed)."""

import pytest
import torch

from tests.scripts_helpers import ROOT, load_module


@pytest.fixture(scope="module")
def script():
    return load_module(ROOT / "benchmarks", "kernels_gpu")


def test_refuses_without_cuda_and_names_the_gpu_command(script, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"run: python benchmarks/kernels_gpu.py \[--quick\]"):
        script.main(["--quick"])


def test_arguments(script):
    quick = script.parse_args(["--quick"])
    assert quick.lengths == script.QUICK_LENGTHS and quick.repeats == 3
    full = script.parse_args([])
    assert full.lengths == [4096, 8192, 16384, 32768, 65536] and full.repeats == 10
    assert script.parse_args(["--ops", "linear", "--lengths", "1024"]).lengths == [1024]
    assert script.device_tag("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def test_ratio_summary_and_plot_code_paths(script, tmp_path):
    rows = {"sdpa": {"forward_ms": 2.0, "train_ms": 8.0, "train_peak_mib": 100.0},
            "torch": {"forward_ms": 4.0, "train_ms": 16.0, "train_peak_mib": 400.0},
            "triton": {"forward_ms": 1.0, "train_ms": 4.0, "train_peak_mib": 50.0},
            "fla chunk_simple_gla": {"forward_error": "out of memory", "train_error": "out of memory"}}
    script.add_ratios(rows)
    assert rows["triton"]["train_ms_vs_sdpa"] == 0.5 and rows["triton"]["train_peak_mib_vs_torch"] == 0.125
    made_up = {"device": "test", "benchmarks": {"decayed linear attention": {"4096": rows}}}
    lines = script.summary_lines(made_up)
    assert any("out of memory" in line for line in lines) and any("triton" in line for line in lines)
    script.plot(made_up, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("kind", ["local", "lsh"])
def test_the_windowed_cases_capture_the_layers_call(script, monkeypatch, kind):
    """The windowed rows time the op on the inputs a real layer gives it, caught at the call (the first GPU run
    found the catcher missing an argument the LSH layer passes)."""
    monkeypatch.setattr(script, "DEVICE", "cpu")
    q, k, v, mask, scale = script.captured_window_call(kind, 4 * script.CHUNK)
    assert q.dim() == 4 and k.shape == q.shape == v.shape and q.shape[-1] == script.HEAD_DIM
    assert tuple(mask.positions.shape) == tuple(q.shape[:3]) and scale > 0


def test_fla_rows_can_be_left_out(script, monkeypatch):
    """`--no_fla` (the speed stage of benchmarks/gpu_session.sh: fla's cold-cache autotuning took a whole step's
    limit) builds no fla rows; otherwise each fla function given gets its row."""
    assert script.parse_args(["--no_fla"]).no_fla and not script.parse_args([]).no_fla
    monkeypatch.setattr(script, "DEVICE", "cpu")
    without = script.linear_steps(2 * script.CHUNK, {})
    assert not any(name.startswith("fla") for name in without) and {"triton", "torch"} <= set(without)
    given = script.linear_steps(2 * script.CHUNK, {"fla chunk_linear_attn": lambda *a, **k: None})
    assert set(given) == set(without) | {"fla chunk_linear_attn"}
