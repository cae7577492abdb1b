"""What a `--model_name_or_path` (or a converter's SRC) names, checked before transformers reads it: transformers
would answer a missing folder with "Repo id must be ..." and a training checkpoint with "Should have a model_type",
neither of which says what is wrong. A name that is not a local path is left to transformers (a Hub id)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from attnzoo.training.checkpoints import MANIFEST, STEP_DIR


def check_model_source(name: str | Path, flag: str = "--model_name_or_path") -> None:
    """Raise ValueError when `name` is a local path that holds no saved model, saying what it holds instead."""
    path = Path(name)
    looks_local = path.exists() or str(name).startswith((".", "/", "~")) or len(path.parts) > 2 or path.suffix != ""
    if not looks_local:
        return  # a Hub id ("user/model"): transformers resolves it
    if not path.exists():
        raise ValueError(f"{flag} {name}: no such folder. Pass a folder that save_pretrained wrote (a training run's "
                         "--output_dir) or a Hub id.")
    if not path.is_dir():
        raise ValueError(f"{flag} {name} is a file; pass the folder that holds it (with its config.json).")
    if (path / "config.json").is_file():
        _check_weights(path, flag)
        return
    if STEP_DIR.match(path.name) or (path / MANIFEST).is_file():
        run = path.parent.parent
        raise ValueError(f"{flag} {name} is a training checkpoint (optimizer and RNG state for resuming), not a saved "
                         f"model. The run's model is in {run}; to continue that training, pass "
                         f"--resume_from_checkpoint {name} with --output_dir {run}.")
    raise ValueError(f"{flag} {name} holds no config.json, so it is not a saved model folder; pass the folder "
                     "save_pretrained wrote.")


def _check_weights(folder: Path, flag: str) -> None:
    """The check `from_pretrained` of attnzoo's models makes on failure (`safetensors_problem`), made first."""
    from attnzoo.modeling.base_models import safetensors_problem

    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ValueError(f"{flag} {folder}: {weights.name} is damaged ({problem}): cut short or corrupted while "
                             "being written or copied. Copy or save it again.")


@contextmanager
def reading_model_source(name: str | Path, flag: str = "--model_name_or_path"):
    """Around the first `from_pretrained(name)`: a local path is checked first (`check_model_source`); a name that is
    no local folder and fails to load as a Hub id gets an error that names both readings."""
    check_model_source(name, flag)
    try:
        yield
    except (OSError, ValueError) as error:
        if Path(name).exists():
            raise
        raise ValueError(f"{flag} {name}: there is no such local folder, and loading it as a Hub id failed "
                         f"({type(error).__name__}: {error}). Check the path (a run's --output_dir) or the Hub "
                         "id.") from error
