"""What the benchmark scripts share: device sync, peak-memory readings, median timing, running a measurement in a
fresh worker process (so one configuration's memory cannot inflate another's), and telling their own reports
(benchmarks/owned_outputs.py) from other files."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on CPU); `device` is a name ("cuda", "cuda:1") or a torch.device."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def step_seconds(step, device, repeats: int) -> list[float]:
    """Wall-clock seconds of `repeats` runs of `step()`, each between two device syncs."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def rss_peak_mib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_step_with_peak(step, device: str, repeats: int) -> tuple[float, float]:
    """(median seconds of `step()` over `repeats` runs, peak MiB of one run above what was held before it).

    CUDA: `max_memory_allocated` during a step after a warm-up step (parameters, gradients and kernels already
    allocated and subtracted). CPU: growth of the process's peak RSS during the first step, so gradients are
    included; run each configuration in its own process (`run_worker`) for this to mean anything.
    """
    if device == "cuda":
        step()
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync(device)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        before = rss_peak_mib()
        step()
        peak = rss_peak_mib() - before
    return statistics.median(step_seconds(step, device, repeats)), peak


def run_worker(script: str, args: list[str]) -> dict | None:
    """Run `python script --worker ARGS` and return the JSON object it prints last (None, with its error, if it
    failed, e.g. out of memory)."""
    done = subprocess.run([sys.executable, script, "--worker", *args], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"worker {args} failed:\n{done.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def device_problem(device: str) -> str | None:
    """None when `device` is "cpu" or a CUDA device this machine has ("cuda", "cuda:N"), else what is wrong with it
    and the fix, for the benchmark's own refusal. Asks the driver for the count only: no CUDA context is made here,
    whose GPU memory a benchmark's workers could not use."""
    if device == "cpu":
        return None
    kind, colon, index = device.partition(":")
    if kind != "cuda" or (colon and not (index.isascii() and index.isdigit())):  # int() refuses "²", isdigit not
        return "use cpu, cuda or cuda:N"
    import torch

    if not torch.cuda.is_available() or int(index or 0) >= torch.cuda.device_count():
        return "no such CUDA device is visible here; use --device cpu"
    return None


def cuda_device_name(device: str = "cuda") -> str:
    """The name of a CUDA device, read in a child process: a benchmark that measures in worker processes needs it
    before they start (its report's setup), and reading it here would give this process a CUDA context, GPU memory
    the workers then cannot use."""
    done = subprocess.run([sys.executable, "-c", f"import torch; print(torch.cuda.get_device_name({device!r}))"],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def report_check(*keys: str, benchmark: str, **equal):
    """A report check (owned_outputs.require_keys(*keys, benchmark=benchmark)) that also wants each top-level key of
    `equal` to hold that value: what tells an unmarked report of this benchmark (from before reports were marked)
    from another benchmark's with the same keys (their "experiment" lines differ)."""
    from owned_outputs import require_keys

    has_keys = require_keys(*keys, *equal, benchmark=benchmark)

    def validate(report: dict) -> None:
        has_keys(report)
        for key, value in equal.items():
            if report[key] != value:
                raise ValueError(f"its {key!r} is {report[key]!r}, not {value!r}")
    return validate


def setup_or_legacy(legacy):
    """`setup_of` for owned_outputs.report_target: a marked report's "setup"; for an unmarked one (from before
    reports were marked and stored their setup), the setup `legacy(report)` reads from what it stored, so that a
    run of the same setup replaces the committed report."""
    def setup_of(report: dict):
        if "benchmark" in report:
            return report.get("setup")
        try:
            return legacy(report)
        except (KeyError, TypeError, ValueError, AttributeError):  # stored otherwise: a setup of its own, kept
            return None
    return setup_of


def write_between_markers(path, start: str, end: str, body: str) -> None:
    """Replace what lies between the lines `start` and `end` of the text file `path` by `body` (a README table
    that a benchmark renders from its results); ValueError when the markers are missing."""
    text = path.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} markers to put the table between.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def tensor_bytes(value) -> int:
    """The bytes of the tensors in `value` (a tensor, or dicts, lists and tuples of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def cache_state_bytes(cache) -> int:
    """Bytes a decoding cache holds: every tensor of every layer (its attributes, and their dicts and lists), what
    generation keeps per batch. A recurrent or windowed state stays the same size; a KV cache grows."""
    return sum(tensor_bytes(vars(layer)) for layer in cache.layers)


def cpu_environment() -> dict:
    """The versions and the machine a CPU benchmark's report names."""
    import os
    import platform

    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "cpu": platform.processor() or
            platform.machine(), "cores": os.cpu_count()}


def measure_missing_rows(report: dict, jobs: list[dict], key: tuple[str, ...], measure_job, keep,
                         remeasure: bool = False) -> None:
    """Measure each job whose `key` fields have no row in `report["rows"]` yet (every job with `remeasure`), one
    worker process each (`measure_job(job)`, run_worker's result: None when the worker failed, which leaves an
    earlier row as it was), and after every row call `keep(report)`, so a stopped run keeps what it measured. A row
    is the job's key fields and what the worker returned; it replaces the row with the same key."""
    done = set() if remeasure else {tuple(r[k] for k in key) for r in report["rows"]}
    for job in jobs:
        job_key = tuple(job[k] for k in key)
        if job_key in done:
            continue
        row = measure_job(job)
        if row is None:
            continue
        row = {**dict(zip(key, job_key, strict=True)), **row}
        print(json.dumps(row), flush=True)
        report["rows"] = [r for r in report["rows"] if tuple(r[k] for k in key) != job_key] + [row]
        keep(report)


def rows_report_check(benchmark: str, *row_fields: str):
    """The report check of a benchmark whose report is {"benchmark": its label, "setup": {...}, "rows": [...]},
    each row holding `row_fields`: raises ValueError saying what does not fit (owned_outputs reads it)."""

    def validate(report: dict) -> None:
        if report.get("benchmark") != benchmark:
            raise ValueError(f"it is not marked as a report of {benchmark}")
        if not isinstance(report.get("rows"), list) or not isinstance(report.get("setup"), dict):
            raise ValueError("it has no 'rows' list and 'setup' object")
        for row in report["rows"]:
            missing = set(row_fields) - set(row)
            if missing:
                raise ValueError(f"a row lacks {sorted(missing)}")

    return validate


def add_report_arguments(parser, committed) -> None:
    """The arguments of a benchmark that measures its rows in worker processes into one report: the hidden
    `--worker` (a job, as JSON), `--results` (default `committed`) and `--remeasure`."""
    import argparse
    from pathlib import Path

    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, default=committed)
    parser.add_argument("--remeasure", action="store_true", help="measure every row, not only missing ones")


def save_figure(fig, path) -> None:
    """Lay out, write and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
