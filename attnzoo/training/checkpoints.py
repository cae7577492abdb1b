"""Training-state checkpoints (`accelerator.save_state`) named by optimizer step, and finding the one to resume."""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def resolve_resume(output_dir: str | Path, resume_from: str | None) -> tuple[Path | None, int]:
    """(checkpoint folder, its step) for `--resume_from_checkpoint` = a folder, "latest", or None (fresh start).

    "latest" with no checkpoint yet starts fresh, so a restarted job can always pass it.
    """
    if not resume_from:
        return None, 0
    if resume_from == "latest":
        root = Path(output_dir) / "checkpoints"
        steps = sorted(int(m.group(1)) for p in root.glob("step_*") if (m := STEP_DIR.match(p.name)))
        return (checkpoint_dir(output_dir, steps[-1]), steps[-1]) if steps else (None, 0)
    path = Path(resume_from)
    match = STEP_DIR.match(path.name)
    if not path.is_dir() or match is None:
        raise ValueError(f"--resume_from_checkpoint {resume_from} must be 'latest' or a step_N folder written by "
                         "this script.")
    return path, int(match.group(1))
