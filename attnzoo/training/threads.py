"""CPU threads per training process. `accelerate launch` sets OMP_NUM_THREADS=1 unless told otherwise, which leaves
a single CPU process on one core; the scripts instead split the machine's cores between the local processes."""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's or a scheduler's limit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_cpu_threads(requested: int, device: torch.device) -> int:
    """On a CPU device, use `requested` threads (0: the available cores divided by the processes on this machine,
    LOCAL_WORLD_SIZE, as torchrun and accelerate set it). Returns the thread count (unchanged off the CPU)."""
    if device.type != "cpu":
        return torch.get_num_threads()
    if requested < 0:
        raise ValueError(f"--cpu_threads={requested} is invalid: set 0 (all cores, split between processes) or a "
                         "positive thread count.")
    if requested == 0:
        requested = max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.set_num_threads(requested)
    return requested
