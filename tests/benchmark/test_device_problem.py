"""`benchmarks/harness.device_problem`, the one device check of the benchmarks that take --device: cpu and the CUDA
devices this machine has pass; every other spelling, and a device index past the driver's count, is refused with the
fix (the CUDA driver faked here, so that the cases run on a machine without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.scripts_helpers import ROOT, load_module

harness = load_module(ROOT / "benchmarks", "harness")


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:1"])
def test_cpu_and_the_devices_the_driver_counts_pass(two_gpus, device):
    assert harness.device_problem(device) is None


@pytest.mark.parametrize("device", ["cuda:2", "cuda:10"])
def test_an_index_past_the_driver_count_is_refused(two_gpus, device):
    assert harness.device_problem(device) == "no such CUDA device is visible here; use --device cpu"


@pytest.mark.parametrize("device", ["tpu", "cudax", "cuda:", "cuda:x", "cuda:-1", "cuda:\u00b2", "cuda:\u0661", "CPU"])
def test_other_spellings_are_refused_before_the_driver_is_asked(two_gpus, device):
    assert harness.device_problem(device) == "use cpu, cuda or cuda:N"


def test_without_a_driver_every_cuda_device_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert harness.device_problem("cuda") == "no such CUDA device is visible here; use --device cpu"
    assert harness.device_problem("cpu") is None
