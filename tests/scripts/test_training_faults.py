"""Faults injected into training (attnzoo/training/faults.py, checkpoints.py, data_checks.py): damaged and failed
checkpoints, non-finite steps, stop signals (in process, and SIGTERM sent to `accelerate launch`ed runs of a
Performer and a 2-process Reformer), malformed JSON lines, text and images."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

import attnzoo.training.loop as loop
from attnzoo.training.checkpoints import (
    CheckpointSaveError,
    checkpoint_dir,
    list_checkpoints,
    read_loop_state,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from attnzoo.training.faults import NonFiniteStepsError, TrainingGuard
from attnzoo.training.tracking import read_metrics
from tests.scripts_helpers import (
    QUIET,
    accelerate_command,
    assert_identical_weights,
    english_text,
    launch,
    launched,
    run_script,
    script_env,
    tiny_model,
    weights,
    write_image_folders,
)


# -- a small real training state ------------------------------------------------------------------------------------
def guard_args(**values):
    return SimpleNamespace(**{"checkpoints_total_limit": 0, "max_nonfinite_steps": 10, "max_failed_saves": 2,
                              **values})


def tiny_training_state(optimizer_class=None):
    """An Accelerator with a prepared linear model, AdamW (fused, as the scripts build it) and a schedule."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = (optimizer_class or (lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)))(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def take_step(state, guard=None, scale=1.0):
    accelerator, model, optimizer, scheduler = state
    inputs = torch.arange(8.0).reshape(2, 4)
    return loop.training_step(accelerator, model, optimizer, scheduler, 1.0,
                              lambda: model(inputs).pow(2).mean() * scale, guard)


def saved_states(tmp_path, steps=(2, 4)):
    state = tiny_training_state()
    for step in steps:
        take_step(state)
        save_checkpoint(state[0], tmp_path, step)
    return state


def truncate(path: Path, keep: int = 100):
    path.write_bytes(path.read_bytes()[:keep])


# -- checkpoint integrity -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated weights", "missing optimizer", "truncated rng state"])
def test_latest_falls_back_past_a_damaged_checkpoint_with_a_warning(tmp_path, damage):
    state = saved_states(tmp_path)
    latest = checkpoint_dir(tmp_path, 4)
    assert json.loads((latest / "manifest.json").read_text())["step"] == 4 and not verify_checkpoint(latest)
    if damage == "truncated weights":
        truncate(latest / "model.safetensors")
    elif damage == "missing optimizer":
        (latest / "optimizer.bin").unlink()
    else:
        truncate(latest / "random_states_0.pkl", 2000)
    problems = verify_checkpoint(latest)
    assert problems and any(name in " ".join(problems) for name in ("model.safetensors", "optimizer.bin",
                                                                    "random_states_0.pkl"))
    warnings = []
    assert resolve_resume(tmp_path, "latest", warn=warnings.append) == (checkpoint_dir(tmp_path, 2), 2)
    assert "step_4" in warnings[0] and "step_2" in warnings[-1]
    with pytest.raises(ValueError, match=r"step_4 is damaged: .*valid ones beside it: \['step_2'\]"):
        resolve_resume(tmp_path, str(latest))
    save_checkpoint(state[0], tmp_path, 4)  # the resumed run reaches step 4 again: its new save replaces the damage
    assert not verify_checkpoint(latest) and sorted(p.name for p in latest.parent.iterdir()) == ["step_2", "step_4"]


def test_only_damaged_checkpoints_stop_the_resume_and_legacy_checkpoints_still_verify(tmp_path):
    saved_states(tmp_path)
    # Without a manifest (a checkpoint written before manifests existed): weights must exist and every file parse.
    legacy = tmp_path / "legacy" / "checkpoints" / "step_3"
    shutil.copytree(checkpoint_dir(tmp_path, 2), legacy)
    (legacy / "manifest.json").unlink()
    assert verify_checkpoint(legacy) == []
    truncate(legacy / "optimizer.bin", 500)
    assert verify_checkpoint(legacy) == ["optimizer.bin: truncated torch.save archive (its zip directory is missing)"]
    (legacy / "model.safetensors").unlink()
    assert "no model weights" in verify_checkpoint(legacy)[0]

    for step in (2, 4):
        truncate(checkpoint_dir(tmp_path, step) / "model.safetensors")
    with pytest.raises(ValueError, match="every checkpoint .* is damaged"):
        resolve_resume(tmp_path, "latest")


def test_rotation_keeps_the_newest_valid_checkpoints_and_leaves_damaged_ones(tmp_path):
    state = tiny_training_state()
    for step in (1, 2, 3):
        take_step(state)
        save_checkpoint(state[0], tmp_path, step, total_limit=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    truncate(checkpoint_dir(tmp_path, 3) / "model.safetensors")  # damaged after its save
    take_step(state)
    save_checkpoint(state[0], tmp_path, 4, total_limit=1)
    # step_3 is damaged: neither counted nor deleted; of the valid ones only the new step_4 is kept
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    # resumed from an older step, a new save never rotates itself away, even behind a newer checkpoint
    take_step(state)
    save_checkpoint(state[0], tmp_path, 2, total_limit=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3, 4]


def test_a_failed_save_keeps_the_previous_checkpoint_and_says_what_happened(tmp_path, monkeypatch, caplog,
                                                                             capsys):
    state = saved_states(tmp_path, steps=(2,))
    accelerator = state[0]
    before = load_file(checkpoint_dir(tmp_path, 2) / "model.safetensors")

    def disk_full(folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(accelerator, "save_state", disk_full)
    take_step(state)
    with pytest.raises(CheckpointSaveError, match=r"step 4 .*No space left on device.*intact \(valid: \['step_2'\]"):
        save_checkpoint(accelerator, tmp_path, 4)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]  # no step_4.partial
    assert not verify_checkpoint(checkpoint_dir(tmp_path, 2))
    assert torch.equal(load_file(checkpoint_dir(tmp_path, 2) / "model.safetensors")["weight"], before["weight"])

    guard = TrainingGuard(accelerator, guard_args(max_failed_saves=1), tmp_path)
    with caplog.at_level(logging.WARNING):
        assert guard.save(6) is False
    assert "Training goes on" in caplog.text
    with pytest.raises(CheckpointSaveError, match="2 saves in a row failed, more than --max_failed_saves=1"):
        guard.save(8)
    # a stop signal whose checkpoint cannot be written still stops, and says where the run will resume from
    stopping = TrainingGuard(accelerator, guard_args(), tmp_path)
    stopping._on_signal(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as stop:
        stopping.after_step(10, {}, checkpoint_now=False)
    assert stop.value.code == 143
    assert "could not be saved (see above); resuming continues from the newest valid checkpoint (step_2)" in \
        capsys.readouterr().out


# -- non-finite steps -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["fused AdamW", "SGD"])
def test_a_non_finite_step_changes_nothing_and_is_counted_when_the_flags_are_read(tmp_path, optimizer):
    state = tiny_training_state(None if optimizer == "fused AdamW" else lambda p: torch.optim.SGD(p, lr=0.1,
                                                                                                   momentum=0.9))
    accelerator, model, opt, _ = state
    guard = TrainingGuard(accelerator, guard_args(max_nonfinite_steps=1), tmp_path)
    take_step(state, guard)
    guard.after_step(1, {}, checkpoint_now=False)
    weights_before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    take_step(state, guard, scale=float("nan"))
    assert all(torch.equal(weights_before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(optimizer_before[k], v) for k, v in opt.state_dict()["state"][0].items())
    guard.after_step(2, {}, checkpoint_now=False)  # not a logging step: the flag is not read yet
    assert guard.skipped_steps == 0
    take_step(state, guard)
    assert not torch.equal(weights_before["weight"], model.state_dict()["weight"])
    record = {"train_loss": 1.0}
    guard.after_step(3, record, checkpoint_now=False)
    assert record["skipped_at"] == [2] and record["skipped_steps"] == 1 and guard.state_dict()["skipped_steps"] == 1
    take_step(state, guard, scale=float("inf"))
    with pytest.raises(NonFiniteStepsError, match=r"step 4: 2 optimizer steps .*steps \[2, 4\].*--max_nonfinite_st"
                                                  r"eps=1.*step_4.*--learning_rate"):
        guard.after_step(4, {"train_loss": 1.0}, checkpoint_now=False)
    assert read_loop_state(checkpoint_dir(tmp_path, 4))["skipped_steps"] == 2


def test_running_mean_leaves_non_finite_losses_out():
    accelerator = Accelerator(cpu=True)
    mean = loop.RunningMean()
    for value in (1.0, float("nan"), 3.0):
        mean.add(torch.tensor(value))
    assert mean.pop(accelerator) == 2.0 and mean.pop(accelerator) is None
    mean.add(torch.tensor(float("inf")))
    assert torch.isnan(torch.tensor(mean.pop(accelerator)))


# -- the scripts, in process ----------------------------------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(english_text()[:1350])
    return path


def lm_args(corpus, out, *extra):
    return ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "6", "--checkpointing_steps", "4",
            "--gradient_accumulation_steps", "2", "--heldout_fraction", "0.2", "--logging_steps", "1",
            "--max_eval_batches", "1", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--num_warmup_steps", "2", "--learning_rate", "3e-3", "--sample_tokens", "0", "--output_dir", out,
            *tiny_model("softmax", "hidden_dropout_prob=0.1"), *QUIET, *extra]


def inject_at_micro_batch(monkeypatch, call: int, change_loss):
    """Wrap the shared training_step (the scripts import it when loaded) so that micro-batch `call` (1-based) runs
    `change_loss(compute_loss)` instead of `compute_loss`."""
    original, calls = loop.training_step, [0]

    def training_step(accelerator, model, optimizer, scheduler, max_grad_norm, compute_loss, guard=None):
        calls[0] += 1
        if calls[0] == call:
            compute_loss = change_loss(compute_loss)
        return original(accelerator, model, optimizer, scheduler, max_grad_norm, compute_loss, guard)

    monkeypatch.setattr(loop, "training_step", training_step)


def test_sigterm_in_process_finishes_the_step_saves_and_resumes_bit_exactly(tmp_path, corpus, monkeypatch):
    run_script("train_lm", lm_args(corpus, tmp_path / "full"))
    stopped = tmp_path / "stopped"
    handler_before = signal.getsignal(signal.SIGTERM)

    def terminated(compute_loss):
        def loss():
            signal.raise_signal(signal.SIGTERM)  # during the first micro-batch of step 3
            return compute_loss()
        return loss

    inject_at_micro_batch(monkeypatch, 5, terminated)
    with pytest.raises(SystemExit) as stop:
        run_script("train_lm", lm_args(corpus, stopped))
    assert stop.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == handler_before
    assert [s for s, _ in list_checkpoints(stopped)] == [3] and not (stopped / "model.safetensors").exists()
    monkeypatch.undo()
    # the checkpoint keeps the seconds trained before it; the resumed run's clock counts on from them (set far above
    # what this run takes, so that only a carried-over clock can reach it)
    manifest = checkpoint_dir(stopped, 3) / "manifest.json"
    saved = json.loads(manifest.read_text())
    assert 0.0 < saved["loop_state"]["train_seconds"] < 600.0
    saved["loop_state"]["train_seconds"] = 1000.0
    manifest.write_text(json.dumps(saved))
    run_script("train_lm", [*lm_args(corpus, stopped), "--resume_from_checkpoint", "latest"])
    assert_identical_weights(weights(tmp_path / "full"), weights(stopped))
    resumed = [row for row in read_metrics(stopped / "metrics.jsonl") if row["step"] > 3 and "elapsed_s" in row]
    assert resumed and all(1000.0 <= row["elapsed_s"] < 1600.0 for row in resumed)
    assert 1000.0 <= json.loads((stopped / "all_results.json").read_text())["train_seconds"] < 1600.0


def test_nan_loss_skips_the_update_logs_it_and_stops_at_the_limit(tmp_path, corpus, monkeypatch):
    out = tmp_path / "skipped"
    inject_at_micro_batch(monkeypatch, 6, lambda compute_loss: (lambda: compute_loss() * float("nan")))
    run_script("train_lm", lm_args(corpus, out, "--checkpointing_steps", "1"))
    # step 3 (micro-batches 5 and 6) changed nothing: weights and optimizer state equal those after step 2
    step2, step3, step4 = (checkpoint_dir(out, s) for s in (2, 3, 4))
    assert_identical_weights(load_file(step2 / "model.safetensors"), load_file(step3 / "model.safetensors"))
    optimizer2, optimizer3 = (torch.load(s / "optimizer.bin", weights_only=True)["state"] for s in (step2, step3))
    assert all(torch.equal(optimizer2[0][k], optimizer3[0][k]) for k in optimizer2[0])
    after3, after4 = (load_file(s / "model.safetensors") for s in (step3, step4))
    assert any(not torch.equal(after3[k], after4[k]) for k in after3), "step 4 trains again"
    records = read_metrics(out / "metrics.jsonl")
    assert [r.get("skipped_steps") for r in records] == [None, None, 1, 1, 1, 1]
    assert records[2]["skipped_at"] == [3] and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in records)
    assert all(torch.isfinite(w).all() for w in weights(out).values())

    inject_at_micro_batch(monkeypatch, 6, lambda compute_loss: (lambda: compute_loss() * float("nan")))
    with pytest.raises(NonFiniteStepsError, match=r"step 3: 1 optimizer steps.*--max_nonfinite_steps=0"):
        run_script("train_lm", lm_args(corpus, tmp_path / "stopped", "--max_nonfinite_steps", "0"))
    saved = read_loop_state(checkpoint_dir(tmp_path / "stopped", 3))
    assert {k: saved[k] for k in ("skipped_steps", "latest_skipped")} == {"skipped_steps": 1, "latest_skipped": [3]}


def test_a_failing_save_mid_run_is_reported_and_training_goes_on(tmp_path, corpus, monkeypatch, caplog):
    original, calls = Accelerator.save_state, [0]

    def save_state(self, folder, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, folder, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        run_script("train_lm", lm_args(corpus, out, "--checkpointing_steps", "2", "--checkpoints_total_limit", "1"))
    assert "could not save the checkpoint of step 4" in caplog.text and "['step_2']" in caplog.text
    assert [s for s, _ in list_checkpoints(out)] == [6] and (out / "model.safetensors").is_file()


def test_end_of_run_sample_fits_the_model_positions(tmp_path, corpus):
    """--block_size 16 with the default 120-token sample: the model has 16 positions, so the sample is clipped."""
    out = tmp_path / "run"
    args = [a for a in lm_args(corpus, out, "--max_train_steps", "1", "--block_size", "16") if a != "--sample_tokens"]
    args.remove("0")
    run_script("train_lm", args)
    assert (out / "model.safetensors").is_file()


def test_fault_arguments_are_checked(tmp_path, corpus):
    for name in ("--max_nonfinite_steps", "--max_failed_saves"):
        with pytest.raises(ValueError, match=f"{name}=-1 is invalid"):
            run_script("train_lm", lm_args(corpus, tmp_path / "o", name, "-1"))


# -- malformed data -------------------------------------------------------------------------------------------------
def write_pairs(path: Path, bad_lines: dict[int, bytes], count: int = 12) -> Path:
    lines = [json.dumps({"translation": {"en": f"number {i}", "de": f"Nummer {i}"}}).encode() for i in range(count)]
    for number, raw in bad_lines.items():
        lines[number - 1] = raw
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


BAD_PAIRS = {3: b'{"translation": {"en": "cut', 5: json.dumps({"translation": {"en": "only"}}).encode(),
             7: '{"translation": {"en": "caf\xe9", "de": "x"}}'.encode("latin-1"), 9: b'["a list"]'}


def corpus_args(tmp_path, skip: bool):
    train = write_pairs(tmp_path / "train.jsonl", BAD_PAIRS)
    validation = write_pairs(tmp_path / "validation.jsonl", {})
    return SimpleNamespace(dataset_name=None, train_file=str(train), validation_file=str(validation), test_file=None,
                           source_lang="en", target_lang="de", max_train_samples=0, max_eval_samples=0,
                           skip_bad_examples=skip)


def test_malformed_translation_lines_are_named_or_skipped(tmp_path, caplog):
    from attnzoo.training.translation_data import load_parallel_corpus

    with pytest.raises(ValueError) as error:
        load_parallel_corpus(corpus_args(tmp_path, skip=False))
    message = str(error.value)
    for number, problem in ((3, "not valid JSON"), (5, "'translation' has no 'de' text"), (7, "not UTF-8"),
                            (9, "not a JSON object")):
        assert f"train.jsonl:{number}: {problem}" in message
    assert "4 malformed translation pair(s) of 12" in message and "--skip_bad_examples" in message
    with caplog.at_level(logging.WARNING):
        raw = load_parallel_corpus(corpus_args(tmp_path, skip=True))
    assert len(raw["train"]) == 8 and len(raw["validation"]) == 12 and "skipped 4 malformed" in caplog.text
    assert raw["train"][2]["translation"] == {"en": "number 3", "de": "Nummer 3"}


def test_the_translation_script_names_a_malformed_line(tmp_path):
    args = corpus_args(tmp_path, skip=False)
    with pytest.raises(ValueError, match=r"train.jsonl:3: not valid JSON"):
        run_script("train_translation", ["--train_file", args.train_file, "--validation_file", args.validation_file,
                                         "--max_train_steps", "1", "--output_dir", tmp_path / "o", *QUIET])


def test_text_that_is_not_utf8_and_bad_text_rows_are_named_or_skipped(tmp_path, caplog):
    from attnzoo.training.data_checks import read_utf8_text
    from attnzoo.training.text_data import load_text_splits

    path = tmp_path / "notes.txt"
    path.write_bytes("first line\nsecond caf\xe9 line\nthird\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"notes.txt:2: not UTF-8 text \(byte 0xe9 at offset 21"):
        read_utf8_text(path, skip_bad=False)
    with caplog.at_level(logging.WARNING):
        assert read_utf8_text(path, skip_bad=True) == "first line\nthird\n"
    assert "skipped 1 line(s)" in caplog.text

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": "x" * 300}) + "\n" for _ in range(6)) + '{"body": "y"}\n')
    args = SimpleNamespace(dataset_name=None, train_file=str(rows), validation_file=None, text_column="text",
                           heldout_fraction=0.2, skip_bad_examples=False)
    with pytest.raises(ValueError, match=r"rows.jsonl:7: no 'text' field .*--text_column"):
        load_text_splits(args, None, byte_level=True)
    args.skip_bad_examples = True
    train, heldout = load_text_splits(args, None, byte_level=True)
    assert train.numel() + heldout.numel() == 6 * 300 + 5  # six rows joined by newlines

    table = tmp_path / "rows.csv"  # a CSV with one latin-1 row: datasets' own error names neither file nor line
    table.write_bytes(("text\n" + "".join("x" * 300 + "\n" for _ in range(5)) + "caf\xe9\n").encode("latin-1"))
    args = SimpleNamespace(dataset_name=None, train_file=str(table), validation_file=None, text_column="text",
                           heldout_fraction=0.2, skip_bad_examples=False)
    with pytest.raises(ValueError, match=r"rows.csv:7: not UTF-8 text"):
        load_text_splits(args, None, byte_level=True)
    args.skip_bad_examples = True
    train, heldout = load_text_splits(args, None, byte_level=True)
    assert train.numel() + heldout.numel() == 5 * 300 + 4


def test_unreadable_images_are_named_or_skipped(tmp_path, caplog):
    from attnzoo.training.classification_data import load_labelled_images, with_transform
    from attnzoo.training.image_data import FolderImages

    folder = write_image_folders(tmp_path / "glyphs", image_size=8, per_class=1, validation=1)
    broken = folder / "train" / "3" / "00000.png"
    truncate(broken, 60)
    (folder / "train" / "5" / "00000.png").write_bytes(b"not an image")
    pixels = FolderImages(folder / "train", 4)
    with pytest.raises(ValueError, match=r"train/3/00000.png: unreadable image .*--skip_bad_examples"):
        [pixels[i] for i in range(len(pixels))]
    with caplog.at_level(logging.WARNING):
        skipping = FolderImages(folder / "train", 4, skip_bad=True)
        assert all(skipping[i].shape == (4, 4, 3) for i in range(len(skipping)))
    assert "2 skipped so far" in caplog.text

    args = SimpleNamespace(dataset_name=None, train_dir=str(folder / "train"),
                           validation_dir=str(folder / "validation"), image_column="image", label_column="label",
                           seed=0, max_train_samples=0, max_eval_samples=0, train_val_split=0.15)
    raw, _ = load_labelled_images(args)
    to_tensor = lambda image: torch.tensor(np.asarray(image), dtype=torch.float32)  # noqa: E731
    labelled = with_transform(raw["train"], to_tensor, "image", "label")
    with pytest.raises(ValueError, match=r"train/(3|5)/00000.png \(item \d\): unreadable image"):
        [labelled[i] for i in range(len(labelled))]
    skipping = with_transform(raw["train"], to_tensor, "image", "label", skip_bad=True)
    labels = [skipping[i]["labels"] for i in range(len(skipping))]
    assert len(labels) == 10 and 3 not in labels and 5 not in labels  # replaced by the next readable image


def test_a_nan_image_batch_is_skipped_by_the_image_script(tmp_path, monkeypatch):
    pytest.importorskip("timm")
    import attnzoo.training.classification_data as classification_data

    images = write_image_folders(tmp_path / "glyphs", image_size=16, per_class=2, validation=1)
    original, calls = classification_data.collate_images, [0]

    def collate_with_a_nan_batch(examples):
        batch = original(examples)
        calls[0] += 1
        if calls[0] == 2:
            batch["pixel_values"][0, 0, 0, 0] = float("nan")
        return batch

    monkeypatch.setattr(classification_data, "collate_images", collate_with_a_nan_batch)
    out = tmp_path / "run"
    run_script("train_image_classification", [
        "--train_dir", images / "train", "--validation_dir", images / "validation", "--image_size", "16",
        "--patch_size", "4", "--per_device_train_batch_size", "4", "--max_train_steps", "3", "--logging_steps", "1",
        "--output_dir", out, *tiny_model("performer"), *QUIET])
    records = read_metrics(out / "metrics.jsonl")
    assert records[1]["skipped_at"] == [2] and records[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(w).all() for w in weights(out).values())


# -- SIGTERM sent to launched runs ----------------------------------------------------------------------------------
def stop_with_sigterm(script: str, argv: list, out: Path, num_processes: int, after_step: int, target: str):
    """Launch a run, wait until it logged `after_step`, send SIGTERM to the whole process group ("group": what a
    terminal's Ctrl-C or a batch scheduler does), to the launcher only ("launcher": `docker stop`, a scheduler that
    signals the job's main process) or to the rank-1 training process only ("rank 1"); returns the launcher's
    (stdout, stderr) once every process has exited."""
    import psutil

    process = subprocess.Popen(accelerate_command(script, [*argv, "--output_dir", out], num_processes),
                               env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.time() + 300
    while process.poll() is None and time.time() < deadline:
        records = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
        if records and records[-1]["step"] >= after_step:
            break
        time.sleep(0.05)
    assert process.poll() is None, f"the run ended before it could be stopped: {process.communicate()[1][-2000:]}"
    if target == "group":
        os.killpg(process.pid, signal.SIGTERM)
    elif target == "launcher":
        process.send_signal(signal.SIGTERM)
    else:
        workers = [p for p in psutil.Process(process.pid).children(recursive=True)
                   if p.environ().get("LOCAL_RANK") == "1"]
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGTERM)
    return process.communicate(timeout=300)  # the pipes close when the last process holding them exits


@pytest.fixture(scope="module")
def performer_run(tmp_path_factory):
    """The arguments of the Performer run both SIGTERM tests stop, and its weights run uninterrupted (a function
    that waits for them): one reference for both, launched in the background when the first test starts, so that it
    runs beside that test's own runs."""
    folder = tmp_path_factory.mktemp("performer_reference")
    corpus = folder / "corpus.txt"
    corpus.write_bytes(english_text()[:20_000])
    args = ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "30", "--logging_steps", "1",
            "--checkpointing_steps", "25", "--per_device_train_batch_size", "4", "--max_eval_batches", "1",
            "--num_warmup_steps", "2", "--sample_tokens", "0", "--cpu_threads", "1",  # two runs at once on two cores
            *tiny_model("performer", "hidden_dropout_prob=0.1"), *QUIET]
    reference = launched("train_lm", [*args, "--output_dir", folder / "full"])

    def full_weights():
        reference.wait()
        return weights(folder / "full")

    yield args, full_weights
    reference.stop()  # if no test got as far as the comparison


@pytest.mark.slow
@pytest.mark.parametrize("target", ["group", "launcher"])
def test_sigterm_to_a_launched_performer_run_then_resume_gives_identical_weights(tmp_path, target, performer_run):
    args, full_weights = performer_run
    stopped = tmp_path / "stopped"
    stdout, _ = stop_with_sigterm("train_lm", args, stopped, 1, after_step=3, target=target)
    assert "stopped by SIGTERM after step" in stdout and "--resume_from_checkpoint latest" in stdout
    step = int(stdout.split("stopped by SIGTERM after step ")[1].split(":")[0])
    assert [s for s, _ in list_checkpoints(stopped)] == [step] and 3 <= step < 25
    assert not (stopped / "model.safetensors").exists()
    done = launch("train_lm", [*args, "--output_dir", stopped, "--resume_from_checkpoint", "latest"])
    assert f"resumed from {checkpoint_dir(stopped, step)}" in done.stdout
    assert_identical_weights(full_weights(), weights(stopped))


@pytest.mark.slow
def test_sigterm_to_one_process_of_a_two_process_reformer_run_stops_both_at_one_step(tmp_path):
    """LSH hashing draws fresh random rotations every forward (lsh_hash_seed unset): the resumed run matches only
    if every process's RNG state was saved at the same step and restored."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:20_000])
    args = ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "20", "--logging_steps", "1",
            "--per_device_train_batch_size", "2", "--max_eval_batches", "1", "--num_warmup_steps", "2",
            "--sample_tokens", "0", *tiny_model("reformer", "lsh_chunk_length=8", "local_chunk_length=8",
                                                "hidden_dropout_prob=0.1"), *QUIET]
    # the uninterrupted reference, beside the stopped and the resumed runs
    with launched("train_lm", [*args, "--output_dir", tmp_path / "full"], num_processes=2) as reference:
        stopped = tmp_path / "stopped"
        stdout, stderr = stop_with_sigterm("train_lm", args, stopped, 2, after_step=3, target="rank 1")
        assert "stopped by SIGTERM after step" in stdout, stderr[-3000:]
        step = int(stdout.split("stopped by SIGTERM after step ")[1].split(":")[0])
        (found_step, folder), = list_checkpoints(stopped)
        assert found_step == step and not verify_checkpoint(folder)
        assert {p.name for p in folder.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
        launch("train_lm", [*args, "--output_dir", stopped, "--resume_from_checkpoint", "latest"], num_processes=2)
        reference.wait()
    assert_identical_weights(weights(tmp_path / "full"), weights(stopped))
