"""Benchmark workers run in the test's own process (a subprocess each costs an import of torch)."""

from __future__ import annotations

import json

import torch


def workers_in_process(bench, monkeypatch):
    """Patch `bench.run_worker` to call `bench.measure` here; yields the jobs it was given and puts torch's thread
    count back after (the workers set theirs)."""
    calls = []
    threads = torch.get_num_threads()

    def worker(script, args):
        calls.append(json.loads(args[0]))
        return bench.measure(json.loads(args[0]))

    monkeypatch.setattr(bench, "run_worker", worker)
    yield calls
    torch.set_num_threads(threads)
