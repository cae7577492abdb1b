"""The run's output folder: one run per folder. A new run refuses a folder that already holds files unless the user
resumes the run in it or asks to start over (transformers' `overwrite_output_dir` convention), and a resumed run must
have the settings that define its model and data: both are checked before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

RUN_ARGS_FILE = "run_args.json"
#: the settings a resumed run must share with the run it continues (the model it rebuilds and the data it skips
#: through); the rest (steps, logging, checkpointing, limits) may change on resume
RESUME_FIXED = ("family", "model", "model_name_or_path", "corpus", "dataset_name", "dataset_config_name",
                "train_file", "block_size", "image_size", "source_lang", "target_lang", "seed")


def check_output_dir(args) -> None:
    """Before a run writes anything: refuse a folder holding another run unless resuming or overwriting, and refuse
    resuming with settings that differ from the run being resumed."""
    folder = Path(args.output_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output_dir {folder} is a file; name a folder for the run.")
    contents = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if getattr(args, "resume_from_checkpoint", None):
        _check_resumed_settings(folder, args)
        return
    if contents and not getattr(args, "overwrite_output_dir", False):
        shown = ", ".join(contents[:5]) + (", ..." if len(contents) > 5 else "")
        raise ValueError(f"--output_dir {folder} already holds files ({shown}); a new run there would overwrite and "
                         "mix with them. Resume that run with --resume_from_checkpoint latest, start over with "
                         "--overwrite_output_dir (the folder's contents are deleted first), or pick another "
                         "--output_dir.")


def start_output_dir(accelerator, args) -> None:
    """After the checks, on the main process: empty the folder when --overwrite_output_dir asks for it, and record
    the run's settings for a later resume. Every process waits for it."""
    folder = Path(args.output_dir)
    if accelerator.is_main_process:
        resuming = bool(getattr(args, "resume_from_checkpoint", None))
        if getattr(args, "overwrite_output_dir", False) and not resuming and folder.is_dir():
            for path in folder.iterdir():
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if not resuming or not (folder / RUN_ARGS_FILE).exists():
            folder.mkdir(parents=True, exist_ok=True)
            values = {name: getattr(args, name) for name in RESUME_FIXED if hasattr(args, name)}
            (folder / RUN_ARGS_FILE).write_text(json.dumps(values, indent=2, default=str))
    accelerator.wait_for_everyone()


def _check_resumed_settings(folder: Path, args) -> None:
    saved_file = folder / RUN_ARGS_FILE
    if not saved_file.exists():  # a run from before run_args.json existed, or nothing to resume yet
        return
    saved = json.loads(saved_file.read_text())
    current = json.loads(json.dumps({name: getattr(args, name) for name in RESUME_FIXED if hasattr(args, name)},
                                    default=str))
    changed = [name for name in saved if name in current and saved[name] != current[name]]
    if changed:
        details = "; ".join(f"--{name} {current[name]!r} (the run in {folder} used {saved[name]!r})"
                            for name in changed)
        raise ValueError(f"cannot resume with different settings: {details}. A checkpoint continues only the run "
                         "it was saved from: resume with the run's own settings, or start a new run with another "
                         "--output_dir.")
