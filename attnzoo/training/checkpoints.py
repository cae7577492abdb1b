"""Training-state checkpoints (`accelerator.save_state`) named by optimizer step: writing them so that a run killed
mid-save never leaves a half-written "latest", finding the one to resume, rotating old ones, and averaging the
weights of the last K (translation, seed 002 H.4)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step_(\d+)$")
PARTIAL_SUFFIX = ".partial"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (step, folder) in step order; ".partial" folders of an interrupted save are skipped."""
    root = Path(output_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def resolve_resume(output_dir: str | Path, resume_from: str | None) -> tuple[Path | None, int]:
    """(checkpoint folder, its step) for `--resume_from_checkpoint` = a folder, "latest", or None (fresh start).

    "latest" with no checkpoint yet starts fresh, so a restarted job can always pass it.
    """
    if not resume_from:
        return None, 0
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        return (found[-1][1], found[-1][0]) if found else (None, 0)
    path = Path(resume_from)
    match = STEP_DIR.match(path.name)
    if not path.is_dir() or match is None:
        raise ValueError(f"--resume_from_checkpoint {resume_from} must be 'latest' or a step_N folder written by "
                         "this script.")
    return path, int(match.group(1))


def save_checkpoint(accelerator, output_dir: str | Path, step: int, total_limit: int = 0) -> Path:
    """`accelerator.save_state` into step_N.partial, then rename to step_N once every process has written its part.

    A job killed while saving leaves only a ".partial" folder, which `--resume_from_checkpoint latest` ignores.
    `total_limit` > 0 keeps only that many newest checkpoints.
    """
    final = checkpoint_dir(output_dir, step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        if total_limit > 0:
            for _, old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The model weights `accelerator.save_state` wrote into a checkpoint folder (the first model)."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(folder / "model.safetensors")
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} holds no full model weights (model.safetensors); checkpoint averaging needs "
                     "unsharded checkpoints, so do not combine --average_last_checkpoints with FSDP sharded state.")


def average_checkpoint_weights(folders: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating-point tensors over `folders` (float64 accumulation); integer tensors (e.g. a
    random-feature redraw counter) are taken from the last folder."""
    if not folders:
        raise ValueError("no checkpoints to average; save some with --checkpointing_steps.")
    states = [load_checkpoint_weights(f) for f in folders]
    keys = states[-1].keys()
    for folder, state in zip(folders, states, strict=True):
        if state.keys() != keys:
            raise ValueError(f"{folder} holds different weights from {folders[-1]}; average checkpoints of one run.")
    averaged = {}
    for key, last in states[-1].items():
        if last.is_floating_point():
            total = sum(s[key].to(torch.float64) for s in states)
            averaged[key] = (total / len(states)).to(last.dtype)
        else:
            averaged[key] = last.clone()
    return averaged
