"""The run's output folder: one run per folder, and no run writes into a folder it did not make.

A run writes only into a folder that is missing, empty, or holds a run of the same script (resumed, with the
settings that define its model and data). Everything else is refused before anything is written, with a message that
says what the folder holds and the safe choices. The rule is written out in docs/training.md ("Output folders").

Each run records itself in `run_args.json`: the script, the family and the model it started from, the settings a
resume must keep, and the top-level files and folders it wrote (`outputs`). `--overwrite_output_dir` deletes only
those, and refuses a folder that holds anything else; a folder without a record is never emptied. The converters
leave the same record beside the model they write, so a later run can say where that model came from.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

RUN_ARGS_FILE = "run_args.json"
#: the settings a resumed run must share with the run it continues (the model it rebuilds and the data it skips
#: through); the rest (steps, logging, checkpointing, limits) may change on resume
RESUME_FIXED = ("family", "model", "model_name_or_path", "corpus", "dataset_name", "dataset_config_name",
                "train_file", "block_size", "image_size", "source_lang", "target_lang", "seed")
#: names every training run may write, recorded when the run starts so that a run killed before its first record
#: update still owns them (the tracker's metrics, the checkpoints, the final model's staging folder)
TRAINING_RUN_NAMES = (RUN_ARGS_FILE, "checkpoints", "metrics.jsonl", "hparams.json", ".final_model.partial")
#: what a model folder holds (a converted model, a `save_pretrained` folder, a run's final model)
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
#: files of runs from before the record listed its outputs (read when such a run is overwritten)
LEGACY_RUN_FILES = ("all_results.json", "training_args.json", "curves.png", "README.md", "generation_config.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "transfer_args.json",
                    "lora_args.json", "eval_results.json", "train_results.json", "trainer_state.json")
#: the flag that names the model a script starts from (for the advice to train a folder's model elsewhere)
START_FLAGS = {"transfer_attention": "--student"}
#: what a run's checkpoints folder holds: its own step folders (and a save's staging or replaced copy)
CHECKPOINT_ENTRY = re.compile(r"^step_\d+(\.partial|\.replaced)?$")


def script_label(script: str) -> str:
    """How messages name a script: `train_lm.py`, or a converter's module (`attnzoo.convert.llama`)."""
    return script if "." in script else f"{script}.py"


def read_run_record(folder: str | Path) -> dict | None:
    """The folder's run record, or None when it has none (or one that is not a JSON object)."""
    path = Path(folder) / RUN_ARGS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (ValueError, OSError):
        return None
    return record if isinstance(record, dict) else None


def recorded_script(folder: Path, record: dict) -> str | None:
    """The script that wrote the record. Records from before they named it: a transfer run kept its own settings
    file beside it; any other one was a training script's, which the settings themselves must then identify."""
    if "script" in record:
        return record["script"]
    if (folder / "transfer_args.json").is_file():
        return "transfer_attention"
    return None


def folder_contents(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _listed(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def describe_folder(folder: Path) -> str:
    """What a non-empty folder holds, in the words the refusals use."""
    contents = folder_contents(folder)
    record = read_run_record(folder)
    if record is not None and record.get("holds") == "benchmark runs":  # a benchmark's folder of runs (benchmarks/)
        return f"the runs of {script_label(record.get('script') or 'a benchmark')} ({_listed(contents)})"
    if record is not None:
        script = recorded_script(folder, record)
        origin = record.get("started_from") or record.get("model_name_or_path") or record.get("student")
        family = (record.get("model_type") or record.get("family") or "").removeprefix("attnzoo_")
        details = ", ".join(part for part in (f"family {family}" if family else "",
                                               f"started from {origin}" if origin else "a new model") if part)
        writer = f"a run of {script_label(script)}" if script else "a run"
        return f"{writer}{f' ({details})' if details else ''}"
    if any(name in contents for name in MODEL_FILES):
        return (f"a model that no attnzoo run recorded ({_listed(contents)}): a converted or `save_pretrained` "
                "model, or a run from before runs were recorded")
    return f"files that are not a run ({_listed(contents)}; no run_args.json)"


def holds_model(folder: Path) -> bool:
    return any((folder / name).is_file() for name in MODEL_FILES)


def has_checkpoint(folder: Path) -> bool:
    """Whether a run left a checkpoint to resume: checkpoints/step_N, or the Trainer's checkpoint-N."""
    return any(p.is_dir() for p in [*(folder / "checkpoints").glob("step_*"), *folder.glob("checkpoint-*")])


def check_output_dir(args, script: str) -> None:
    """Before a run of `script` writes anything: the folder is missing or empty; or it holds this script's run, which
    `--resume_from_checkpoint` continues with the same settings from a checkpoint of its own; or
    `--overwrite_output_dir` asks to delete a run that holds nothing but its own outputs. Anything else raises a
    ValueError that says what the folder holds and the safe choices."""
    folder = Path(args.output_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output_dir {folder} is a file; name a folder for the run.")
    contents = folder_contents(folder)
    resuming = bool(getattr(args, "resume_from_checkpoint", None))
    overwriting = bool(getattr(args, "overwrite_output_dir", False))
    if resuming and overwriting:
        raise ValueError("--resume_from_checkpoint continues the run in --output_dir and --overwrite_output_dir "
                         "deletes it; pass one of them.")
    if resuming:
        _check_resumable(folder, contents, args, script)
    elif contents and overwriting:
        _check_overwritable(folder, contents, args, script)
    elif contents:
        record = read_run_record(folder)
        if record is not None and recorded_script(folder, record) == script:
            resume = ("resume that run with --resume_from_checkpoint latest, " if has_checkpoint(folder) or
                      not holds_model(folder) else "")
            choices = (f"{resume}start over with --overwrite_output_dir (deletes that run's files and nothing "
                       f"else), or {_elsewhere_choices(folder, script)}")
        else:
            choices = _elsewhere_choices(folder, script)
        raise ValueError(f"--output_dir {folder} already holds files: {describe_folder(folder)}. A new run there "
                         f"would overwrite and mix with them; {choices}.")


def _elsewhere_choices(folder: Path, script: str) -> str:
    flag = START_FLAGS.get(script, "--model_name_or_path")
    start_from = (f"; to train the model it holds, keep it and write the run elsewhere: {flag} {folder} "
                  f"--output_dir {folder.name}-trained" if holds_model(folder) else "")
    return f"pick another --output_dir{start_from}"


def _check_resumable(folder: Path, contents: list[str], args, script: str) -> None:
    explicit = args.resume_from_checkpoint != "latest"
    if explicit:  # a step_N (or the Trainer's checkpoint-N) folder: it must be one of this folder's own checkpoints
        checkpoint = Path(args.resume_from_checkpoint)
        inside = checkpoint.resolve().parent in ((folder / "checkpoints").resolve(), folder.resolve())
        if inside and not checkpoint.is_dir():
            raise ValueError(f"--resume_from_checkpoint {checkpoint} does not exist; pass 'latest' (the newest "
                             f"valid checkpoint in {folder}) or one of the run's checkpoint folders. Nothing was "
                             "written.")
        if not inside:
            raise ValueError(f"--resume_from_checkpoint {checkpoint} is not a checkpoint of the run in "
                             f"--output_dir {folder}: a checkpoint continues only the run that wrote it, in its own "
                             f"folder ({folder / 'checkpoints' / 'step_N'}). To train from that run's model, pass "
                             "its final folder as --model_name_or_path with a new --output_dir.")
    if not contents:  # nothing there yet: a restarted job may always pass `latest`; it starts fresh
        return
    record = read_run_record(folder)
    recorded = recorded_script(folder, record) if record is not None else None
    if record is None or (recorded is not None and recorded != script):
        raise ValueError(f"--resume_from_checkpoint: --output_dir {folder} holds {describe_folder(folder)}, not a "
                         f"run of {script_label(script)} to resume. Nothing was written; "
                         f"{_elsewhere_choices(folder, script)}.")
    current = _resume_settings(args)
    if recorded is None:  # an older record: its settings must be this script's own
        missing = [name for name in current if name not in record]
        if missing:
            raise ValueError(f"--resume_from_checkpoint: --output_dir {folder} holds {describe_folder(folder)} whose "
                             f"record has no {missing} settings, so it is not a run of {script_label(script)}. "
                             f"Nothing was written; {_elsewhere_choices(folder, script)}.")
    changed = [name for name in record if name in current and not same_setting(name, record[name], current[name],
                                                                                 args)]
    if changed:
        details = "; ".join(f"--{name} {current[name]!r} (the run in {folder} used {record[name]!r})"
                            for name in changed)
        raise ValueError(f"cannot resume with different settings: {details}. A checkpoint continues only the run "
                         "it was saved from: resume with the run's own settings, or start a new run with another "
                         "--output_dir.")
    if not explicit and not has_checkpoint(folder) and holds_model(folder):
        raise ValueError(f"--resume_from_checkpoint latest: the run in --output_dir {folder} finished and left no "
                         "checkpoint to resume (it saved only its final model), so resuming would train from scratch "
                         f"over that model. Nothing was written; to train that model further, pass "
                         f"--model_name_or_path {folder} --output_dir {folder.name}-continued.")


def _check_overwritable(folder: Path, contents: list[str], args, script: str) -> None:
    record = read_run_record(folder)
    if record is None:
        raise ValueError(f"--overwrite_output_dir: --output_dir {folder} holds {describe_folder(folder)}, so it is "
                         "not a run and is not emptied. Pick another --output_dir.")
    recorded = recorded_script(folder, record)
    if recorded is not None and recorded != script:
        raise ValueError(f"--overwrite_output_dir: --output_dir {folder} holds {describe_folder(folder)}, which this "
                         f"command did not make; --overwrite_output_dir starts over only a run of "
                         f"{script_label(script)}. Nothing was deleted; {_elsewhere_choices(folder, script)}.")
    source = getattr(args, "model_name_or_path", None) or getattr(args, "student", None)
    if source and Path(source).exists() and Path(source).resolve() in (folder.resolve(), *folder.resolve().parents):
        raise ValueError(f"--overwrite_output_dir would delete {source}, the model this run starts from (it is "
                         f"in --output_dir {folder}); nothing was deleted. Write the run elsewhere: --output_dir "
                         f"{folder.name}-trained.")
    others = [name for name in contents if name not in run_outputs(record)]
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir():  # the run's checkpoints folder holds its step folders, nothing else
        others += [f"checkpoints/{p.name}" for p in sorted(checkpoints.iterdir()) if not CHECKPOINT_ENTRY.match(p.name)]
    if others:
        raise ValueError(f"--overwrite_output_dir: --output_dir {folder} holds {describe_folder(folder)} and also "
                         f"files that run did not write ({_listed(others)}); nothing was deleted. Move those files "
                         "away, or pick another --output_dir.")


def same_setting(name: str, saved, current, args) -> bool:
    """Whether a resumed run keeps a recorded setting: `--model` values compared as settings (their order does not
    matter); `--family` does not apply when the run starts from --model_name_or_path (the model has its family)."""
    if name == "family" and getattr(args, "model_name_or_path", None):
        return True
    if name == "model":
        from attnzoo.training.recipes import parse_model_overrides

        try:
            return parse_model_overrides(saved) == parse_model_overrides(current)
        except (ValueError, TypeError, AttributeError):
            return saved == current
    return saved == current


def run_outputs(record: dict) -> set[str]:
    """The top-level names a recorded run wrote (with, for runs from before the record listed them, the names such
    runs wrote: their final model's files and the remote code beside it)."""
    if "outputs" in record:
        return set(record["outputs"])
    return {*TRAINING_RUN_NAMES, *MODEL_FILES, *LEGACY_RUN_FILES}


def _resume_settings(args) -> dict:
    return json.loads(json.dumps({name: getattr(args, name) for name in RESUME_FIXED if hasattr(args, name)},
                                 default=str))


def _legacy_outputs(folder: Path, record: dict) -> list[str]:
    """For a run recorded before `outputs` existed: its files that match what such runs wrote (code files too)."""
    owned = run_outputs(record)
    return [name for name in folder_contents(folder) if name in owned or name.endswith(".py")]


def start_output_dir(accelerator, args, script: str, model_type: str | None = None,
                     started_from: str | None = None) -> None:
    """After the checks, on the main process: delete the earlier run's outputs when --overwrite_output_dir asks for
    it, and record this run (the script, the family `model_type`, the model it `started_from`, the settings a resume
    must keep, the names it writes). A resumed run keeps its record. Every process waits for it."""
    folder = Path(args.output_dir)
    if accelerator.is_main_process:
        resuming = bool(getattr(args, "resume_from_checkpoint", None))
        record = read_run_record(folder)
        if getattr(args, "overwrite_output_dir", False) and not resuming and record is not None:
            owned = run_outputs(record) | (set(_legacy_outputs(folder, record)) if "outputs" not in record else set())
            for name in folder_contents(folder):
                if name in owned:
                    path = folder / name
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            record = None
        if record is None or not resuming:
            record = {"script": script, "model_type": model_type, "started_from": started_from,
                      **_resume_settings(args), "outputs": sorted(TRAINING_RUN_NAMES)}
        elif "outputs" not in record:  # an older run, resumed: from now on it lists what it wrote
            record = {**record, "script": script, "outputs": sorted({*TRAINING_RUN_NAMES,
                                                                      *_legacy_outputs(folder, record)})}
        folder.mkdir(parents=True, exist_ok=True)
        _write_record(folder, record)
    accelerator.wait_for_everyone()


def record_outputs(folder: str | Path, names=None) -> None:
    """Add `names` (default: every top-level name now in `folder`) to the outputs of the folder's run record. Called
    on the main process after a run writes something: the tracker's files, the final model, the results."""
    folder = Path(folder)
    record = read_run_record(folder)
    if record is None:
        return
    names = folder_contents(folder) if names is None else list(names)
    outputs = sorted(set(record.get("outputs", ())) | set(names))
    if outputs != record.get("outputs"):
        _write_record(folder, {**record, "outputs": outputs})


def write_model_record(folder: str | Path, script: str, model_type: str, started_from: str, **settings) -> None:
    """The record a converter leaves beside the model it wrote (every file in the folder is its output)."""
    folder = Path(folder)
    _write_record(folder, {"script": script, "model_type": model_type, "started_from": started_from, **settings,
                           "outputs": sorted({*folder_contents(folder), RUN_ARGS_FILE})})


def write_record(folder: str | Path, record: dict) -> None:
    """Write `record` as the folder's run record, as it is (for a folder that holds something other than one run:
    a benchmark's folder of runs, whose record lists the runs it made)."""
    _write_record(Path(folder), record)


def _write_record(folder: Path, record: dict) -> None:
    partial = folder / (RUN_ARGS_FILE + ".partial")
    partial.write_text(json.dumps(record, indent=2, default=str))
    partial.replace(folder / RUN_ARGS_FILE)
