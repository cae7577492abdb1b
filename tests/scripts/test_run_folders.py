"""One run per --output_dir (issue: a second run into the same folder silently replaced the first one's model and
checkpoints and mixed its metrics), resuming only with the run's own settings, and optimiser settings that are not
numbers a run can use."""

import json
from pathlib import Path

import pytest

from attnzoo.training.run_dir import RUN_ARGS_FILE
from tests.scripts_helpers import QUIET, english_text, run_script, tiny_model, weights

STEPS = ["--block_size", "32", "--max_train_steps", "2", "--per_device_train_batch_size", "4",
         "--per_device_eval_batch_size", "4", "--num_warmup_steps", "1", "--sample_tokens", "0",
         "--checkpointing_steps", "1", *QUIET]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(english_text()[:20_000])
    return path


def train(out, corpus, family="softmax", *extra):
    return run_script("train_lm", ["--train_file", corpus, "--output_dir", out, *tiny_model(family), *STEPS, *extra])


def test_a_second_run_into_a_used_folder_is_refused_and_loses_nothing(tmp_path, corpus):
    out = tmp_path / "run"
    train(out, corpus)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"--output_dir .*run already holds files: a run of train_lm.py \(family "
                                         r"softmax, a new model\).*--resume_from_checkpoint latest"
                                         r".*--overwrite_output_dir.*another --output_dir"):
        train(out, corpus, "performer")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # the first run's model, checkpoints and metrics are untouched


def test_overwrite_output_dir_starts_over_without_leftovers(tmp_path, corpus):
    out = tmp_path / "run"
    train(out, corpus, "softmax", "--max_train_steps", "3")
    assert (out / "checkpoints" / "step_3").is_dir()
    train(out, corpus, "performer", "--overwrite_output_dir")
    assert not (out / "checkpoints" / "step_3").exists()  # nothing of the first run is left to mix in
    assert json.loads((out / "config.json").read_text())["model_type"] == "attnzoo_performer"
    assert json.loads((out / RUN_ARGS_FILE).read_text())["family"] == "performer"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2


def test_resuming_with_another_family_is_refused(tmp_path, corpus):
    out = tmp_path / "run"
    train(out, corpus)
    saved = weights(out)
    with pytest.raises(ValueError, match=r"cannot resume with different settings: --family 'ra' \(the run in .* used "
                                         r"'softmax'\)"):
        train(out, corpus, "ra", "--resume_from_checkpoint", "latest", "--max_train_steps", "3")
    assert weights(out).keys() == saved.keys()
    train(out, corpus, "softmax", "--resume_from_checkpoint", "latest", "--max_train_steps", "3")  # its own settings


@pytest.mark.parametrize("flag, value, message", [
    ("--learning_rate", "inf", r"--learning_rate=inf is invalid: set a positive, finite value"),
    ("--learning_rate", "nan", r"--learning_rate=nan is invalid"),
    ("--adam_beta1", "1.5", r"--adam_beta1=1.5 is invalid: set a value in \[0, 1\)"),
    ("--adam_beta2", "-0.1", r"--adam_beta2=-0.1 is invalid"),
    ("--adam_epsilon", "0", r"--adam_epsilon=0.0 is invalid"),
    ("--weight_decay", "nan", r"--weight_decay=nan is invalid"),
    ("--max_grad_norm", "-1", r"--max_grad_norm=-1.0 is invalid"),
])
def test_optimiser_settings_that_cannot_train_are_refused(tmp_path, corpus, flag, value, message):
    with pytest.raises(ValueError, match=message):
        train(tmp_path / "run", corpus, "softmax", flag, value)
    assert not (tmp_path / "run").exists()


def test_metrics_are_strict_json_when_a_value_is_not_finite(tmp_path):
    from attnzoo.training.tracking import JSONLinesTracker

    def refuse(constant):
        raise ValueError(f"bare {constant} in metrics.jsonl")

    tracker = JSONLinesTracker("run", tmp_path)
    tracker.log({"train_loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3}, step=3)
    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert record == {"step": 3, "train_loss": None, "grad_norm": None, "lr": 1e-3}


def test_a_checkpoint_file_changed_at_the_same_size_is_caught_before_resuming(tmp_path, corpus):
    out = tmp_path / "run"
    train(out, corpus)
    states = out / "checkpoints" / "step_2" / "random_states_0.pkl"
    original = states.read_bytes()
    states.write_bytes(original[:-8] + bytes(8))  # same size, other contents
    with pytest.raises(ValueError, match=r"step_2 is damaged: random_states_0.pkl differs from what was saved \(its "
                                         r"SHA-256 does not match"):
        train(out, corpus, "softmax", "--resume_from_checkpoint", out / "checkpoints" / "step_2",
              "--max_train_steps", "3")
    # `latest` passes over it with a warning and resumes from the newest intact checkpoint
    train(out, corpus, "softmax", "--resume_from_checkpoint", "latest", "--max_train_steps", "3")


def test_a_final_save_on_a_full_disk_leaves_no_half_written_model(tmp_path, corpus, monkeypatch):
    import errno

    from attnzoo.modeling.base_models import ZooPreTrainedModel
    from attnzoo.training.checkpoints import CheckpointSaveError

    written = []
    save_pretrained = ZooPreTrainedModel.save_pretrained

    def full_disk(self, folder, *args, **kwargs):  # most files written, then the disk fills up
        save_pretrained(self, folder, *args, **kwargs)
        written.extend(p.name for p in Path(folder).iterdir())
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ZooPreTrainedModel, "save_pretrained", full_disk)
    out = tmp_path / "run"
    with pytest.raises(CheckpointSaveError, match=r"could not save the final model in .*No space left on device.*"
                                                  r"nothing of it was written there.*--resume_from_checkpoint latest"):
        train(out, corpus)
    assert written and not (out / "config.json").exists() and not (out / ".final_model.partial").exists()
    assert (out / "checkpoints" / "step_2").is_dir()  # the training state survives
    monkeypatch.undo()
    train(out, corpus, "softmax", "--resume_from_checkpoint", "latest")  # the advice works
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_random_states_that_do_not_load_stop_the_resume(tmp_path, corpus):
    """accelerate only logs (at INFO) that a checkpoint's random states failed to load, and goes on; a checkpoint
    from before checksums existed could hide such a file."""
    out = tmp_path / "run"
    train(out, corpus)
    step = out / "checkpoints" / "step_2"
    (step / "random_states_0.pkl").write_bytes(b"not a pickle")
    manifest = json.loads((step / "manifest.json").read_text())
    manifest.pop("sha256")  # as an older checkpoint's manifest
    manifest["files"]["random_states_0.pkl"] = len(b"not a pickle")
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match=r"the random-number states did not load, so the resumed run would not "
                                           r"repeat the uninterrupted one"):
        train(out, corpus, "softmax", "--resume_from_checkpoint", step, "--max_train_steps", "3")
