"""Experiment trackers: TensorBoard when it is installed, and always a JSON-lines file the plots and tests read."""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path

from accelerate.tracking import GeneralTracker, on_main_process

METRICS_FILE = "metrics.jsonl"
REPORT_TO_CHOICES = ("auto", "jsonl", "tensorboard", "all", "none")


class JSONLinesTracker(GeneralTracker):
    """Appends one JSON object per `accelerator.log` call to `OUTPUT_DIR/metrics.jsonl` (step, values, wall time).

    A resumed run keeps appending to the same file; `read_metrics` keeps the last record of each step, so the curves
    of a run killed after its last checkpoint show the resumed values, not the ones that were redone.
    """

    name = "jsonl"
    requires_logging_directory = True

    # Not @on_main_process: that would create accelerate's PartialState before the Accelerator chooses its backend.
    def __init__(self, run_name: str, logging_dir: str | Path):
        super().__init__()
        self.run_name = run_name
        self.path = Path(logging_dir) / METRICS_FILE

    @property
    def tracker(self):
        return self.path

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        (self.path.parent / "hparams.json").write_text(json.dumps(values, indent=2, default=str))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _plain(value):
    """A JSON value: tensors become numbers, and NaN or infinity (a skipped step's loss) become null, which strict
    JSON readers accept (Python's json would write a bare NaN)."""
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl, one per step (the last written wins), in step order."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(record.get("step"), {}).update(record)
    return [by_step[s] for s in sorted(by_step, key=lambda s: -1 if s is None else s)]


def build_trackers(report_to: str, output_dir: str | Path, run_name: str) -> list:
    """The `log_with` list for `Accelerator`: "auto"/"all" = JSON lines, plus TensorBoard if installed."""
    if report_to not in REPORT_TO_CHOICES:
        raise ValueError(f"--report_to {report_to!r} is invalid: use one of {REPORT_TO_CHOICES}.")
    if report_to == "none":
        return []
    trackers: list = [JSONLinesTracker(run_name, output_dir)]
    has_tensorboard = find_spec("tensorboard") is not None or find_spec("tensorboardX") is not None
    if report_to == "tensorboard" and not has_tensorboard:
        raise ValueError("--report_to tensorboard needs the tensorboard package; pip install tensorboard, or use "
                         "--report_to jsonl.")
    if report_to == "tensorboard" or (report_to in ("auto", "all") and has_tensorboard):
        trackers.append("tensorboard")
    return trackers
