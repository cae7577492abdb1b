"""Training-state checkpoints (`accelerator.save_state`) named by optimizer step: writing them so that a run killed
mid-save never leaves a half-written "latest", finding the one to resume, rotating old ones, and averaging the
weights of the last K (translation, arXiv 2204.04667 appendix H.4)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
PARTIAL_SUFFIX = ".partial"
# Written last into every checkpoint, once all processes have saved their parts: each file's size, and the training
# loop's own counters. Verification compares the files with it (a file cut short or lost after the save shows).
MANIFEST = "manifest.json"
WEIGHT_FILES = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|pytorch_model_fsdp_\d+)$")


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the partial folder was removed and older checkpoints are untouched."""


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoint folders (step, folder) in step order; ".partial" folders of an interrupted save are skipped. A
    listed folder may still be damaged (a file truncated or lost after the save): see `verify_checkpoint`."""
    root = Path(output_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def verify_checkpoint(folder: str | Path, contents: bool = False) -> list[str]:
    """What is wrong with a checkpoint folder (an empty list: nothing found).

    With a manifest: every file it lists exists with its size, and with `contents` (before resuming from it, and
    right after writing it) its SHA-256 matches the manifest's, so a file overwritten at the same size is caught.
    Without one (a checkpoint written before manifests existed): some model weights exist. Then every safetensors
    file's header must parse and cover the file, and every torch.save archive must have its zip directory (which a
    truncated file loses)."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = []
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text())
            files, digests = recorded["files"], recorded.get("sha256", {})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return [f"{MANIFEST} is unreadable ({err})"]
        for name, size in sorted(files.items()):
            path = folder / name
            if not path.is_file():
                problems.append(f"{name} is missing")
            elif path.stat().st_size != size:
                problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {size} (cut short?)")
            elif contents and name in digests and _sha256(path) != digests[name]:
                problems.append(f"{name} differs from what was saved (its SHA-256 does not match the manifest's)")
        present = [folder / name for name in files if (folder / name).is_file()]
    else:
        present = [p for p in folder.rglob("*") if p.is_file()]
        if not any(WEIGHT_FILES.match(p.name) for p in folder.iterdir()):
            problems.append("no model weights (model.safetensors) and no manifest: not a complete checkpoint")
    for path in sorted(present):
        problem = _file_problem(path)
        if problem:
            problems.append(f"{path.relative_to(folder)}: {problem}")
    return problems


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_problem(path: Path) -> str | None:
    """A cheap content check: the safetensors header, or the zip directory of a torch.save archive."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt"):
                return None
        except Exception as err:  # safetensors raises its own error type for every malformed header
            return f"unreadable safetensors ({err})"
    if path.suffix in (".bin", ".pkl", ".pt"):
        with path.open("rb") as f:
            is_archive = f.read(4) == b"PK\x03\x04"  # torch.save's zip format (older pickles are not checked)
        if is_archive and not zipfile.is_zipfile(path):
            return "truncated torch.save archive (its zip directory is missing)"
    return None


def read_loop_state(folder: str | Path) -> dict:
    """The training loop's counters saved with a checkpoint ({} for a checkpoint without a manifest)."""
    manifest = Path(folder) / MANIFEST
    return json.loads(manifest.read_text()).get("loop_state", {}) if manifest.is_file() else {}


def resolve_resume(output_dir: str | Path, resume_from: str | None,
                   warn: Callable[[str], None] = logger.warning) -> tuple[Path | None, int]:
    """(checkpoint folder, its step) for `--resume_from_checkpoint` = a folder, "latest", or None (fresh start).

    "latest" with no checkpoint yet starts fresh, so a restarted job can always pass it; it takes the newest
    checkpoint that passes `verify_checkpoint`, and `warn`s about each newer damaged one it passes over. A damaged
    checkpoint named explicitly, or only damaged ones, raise ValueError saying what is wrong and what to do.
    """
    if not resume_from:
        return None, 0
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        damaged = []
        for step, folder in reversed(found):
            problems = verify_checkpoint(folder, contents=True)
            if not problems:
                for bad, bad_problems in damaged:
                    warn(f"skipping damaged checkpoint {bad}: {'; '.join(bad_problems)}")
                if damaged:
                    warn(f"resuming from {folder}, the newest valid checkpoint; the steps after {step} are redone.")
                return folder, step
            damaged.append((folder, problems))
        if damaged:
            details = "; ".join(f"{folder.name}: {', '.join(problems)}" for folder, problems in damaged)
            raise ValueError(f"every checkpoint in {Path(output_dir) / 'checkpoints'} is damaged ({details}). Move "
                             "them away to start afresh, or drop --resume_from_checkpoint.")
        return None, 0
    path = Path(resume_from)
    match = STEP_DIR.match(path.name)
    if not path.is_dir() or match is None:
        raise ValueError(f"--resume_from_checkpoint {resume_from} must be 'latest' or a step_N folder written by "
                         "this script.")
    problems = verify_checkpoint(path, contents=True)
    if problems:
        valid = [f.name for _, f in list_checkpoints(path.parent.parent) if f != path and not verify_checkpoint(f)]
        raise ValueError(f"--resume_from_checkpoint {resume_from} is damaged: {'; '.join(problems)}. Resume from "
                         f"another checkpoint (valid ones beside it: {valid or 'none'}), or pass 'latest' to take "
                         "the newest valid one.")
    return path, int(match.group(1))


def any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` is set on any process (a collective: every process must call it)."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "sum").item())


def save_checkpoint(accelerator, output_dir: str | Path, step: int, total_limit: int = 0,
                    loop_state: dict | None = None) -> Path:
    """`accelerator.save_state` into step_N.partial, a manifest once every process has written its part, a check
    that the folder reads back, then the rename to step_N.

    A job killed while saving leaves only a ".partial" folder, which `--resume_from_checkpoint latest` ignores. A
    save that fails on any process (e.g. a full disk) removes the partial folder on every process and raises
    CheckpointSaveError: the older checkpoints are untouched. `total_limit` > 0 then deletes the oldest valid
    checkpoints beyond the newest `total_limit`; the new one is always kept and damaged ones are left in place.
    """
    final = checkpoint_dir(output_dir, step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    error = None
    try:
        accelerator.save_state(str(partial))
    except Exception as err:  # every failure (OSError, a pickling error, ...) is reported the same way
        error = err
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and error is None:
        try:
            _write_manifest(partial, step, loop_state or {})
            problems = verify_checkpoint(partial)
            if problems:
                raise OSError(f"the written files do not read back: {'; '.join(problems)}")
            replaced = final.with_name(final.name + ".replaced")  # a re-saved step: never without a copy on disk
            if final.exists():
                shutil.rmtree(replaced, ignore_errors=True)
                final.rename(replaced)
            partial.rename(final)
            shutil.rmtree(replaced, ignore_errors=True)
        except Exception as err:
            error = err
    if any_process(accelerator, error is not None):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        accelerator.wait_for_everyone()
        valid = [f.name for _, f in list_checkpoints(output_dir) if not verify_checkpoint(f)]
        cause = f"{type(error).__name__}: {error}" if error is not None else "another process failed to write its part"
        raise CheckpointSaveError(f"could not save the checkpoint of step {step} in {final.parent} ({cause}); the "
                                  f"partial folder was removed, the older checkpoints are intact (valid: "
                                  f"{valid or 'none'}). Check free disk space and write access.") from error
    if accelerator.is_main_process and total_limit > 0:
        _rotate(output_dir, step, total_limit)
    accelerator.wait_for_everyone()
    return final


def _write_manifest(folder: Path, step: int, loop_state: dict) -> None:
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    files = {str(p.relative_to(folder)): p.stat().st_size for p in paths}
    digests = {str(p.relative_to(folder)): _sha256(p) for p in paths}
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": files, "sha256": digests,
                                               "loop_state": loop_state}, indent=1))


def _rotate(output_dir: str | Path, new_step: int, total_limit: int) -> None:
    """Delete valid checkpoints older than the newest `total_limit` valid ones, never the one just saved; damaged
    checkpoints are neither counted nor deleted (a person may still want to look at them)."""
    valid = [(step, folder) for step, folder in list_checkpoints(output_dir)
             if step == new_step or not verify_checkpoint(folder)]
    for step, folder in valid[:-total_limit]:
        if step != new_step:
            try:
                shutil.rmtree(folder)
            except OSError as err:
                logger.warning(f"could not delete the old checkpoint {folder} ({err}); delete it by hand.")


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
