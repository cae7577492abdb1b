"""No command writes over a model it did not make (issue: resuming into a converted model's folder, fine-tuning a
classifier into a language-model run, or --overwrite_output_dir on a folder of one's own files replaced or deleted
them, exit code 0). Each test names what it protects; every refusal leaves the folder byte for byte as it was."""

import argparse
import json
from pathlib import Path

import pytest

from attnzoo.training.run_dir import RUN_ARGS_FILE, check_output_dir
from tests.scripts_helpers import QUIET, english_text, load_script, run_script, tiny_model

STEPS = ["--block_size", "32", "--max_train_steps", "2", "--per_device_train_batch_size", "4",
         "--per_device_eval_batch_size", "4", "--num_warmup_steps", "1", "--sample_tokens", "0", *QUIET]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(english_text()[:20_000])
    return path


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def train(out, corpus, *extra):
    return run_script("train_lm", ["--train_file", corpus, "--output_dir", out, *STEPS, *extra])


def train_new(out, corpus, *extra):
    return train(out, corpus, *tiny_model("softmax"), "--checkpointing_steps", "1", *extra)


@pytest.fixture
def converted(tmp_path):
    """A 2-layer Llama converted to Performer, as `python -m attnzoo.convert.llama SRC conv --family performer`."""
    from attnzoo.convert.llama import main as convert_llama
    from tests.convert.test_convert_llama import tiny_source

    source = tmp_path / "llama"
    tiny_source().save_pretrained(source)
    folder = tmp_path / "conv"
    convert_llama([str(source), str(folder), "--family", "performer", "--model", "num_random_features=16"])
    return folder


def test_resuming_into_a_converted_model_is_refused_and_keeps_the_model(converted, corpus):
    record = json.loads((converted / RUN_ARGS_FILE).read_text())
    assert record["script"] == "attnzoo.convert.llama" and record["family"] == "performer"
    assert set(record["outputs"]) == {p.name for p in converted.iterdir()}
    before = snapshot(converted)
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint: --output_dir .*conv holds a run of "
                                         r"attnzoo.convert.llama \(family performer, started from .*llama\), not a "
                                         r"run of train_lm.py to resume. Nothing was written; pick another "
                                         r"--output_dir; to train the model it holds, keep it and write the run "
                                         r"elsewhere: --model_name_or_path .*conv --output_dir conv-trained"):
        train(converted, corpus, "--model_name_or_path", converted, "--resume_from_checkpoint", "latest")
    assert snapshot(converted) == before


def test_resuming_into_a_plain_saved_model_is_refused(tmp_path, corpus):
    from tests.models.test_hf_workflow import tiny_lm

    folder = tmp_path / "saved"
    tiny_lm("softmax").save_pretrained(folder)
    before = snapshot(folder)
    with pytest.raises(ValueError, match=r"holds a model that no attnzoo run recorded \(config.json, .*\): a "
                                         r"converted or `save_pretrained` model.*not a run of train_lm.py to resume"):
        train(folder, corpus, "--model_name_or_path", folder, "--resume_from_checkpoint", "latest")
    assert snapshot(folder) == before


def test_resuming_into_an_older_transfer_run_is_refused(tmp_path):
    """transfer_attention.py's record used to name neither family nor model; its settings file shows the script."""
    folder = tmp_path / "transferred"
    folder.mkdir()
    (folder / RUN_ARGS_FILE).write_text(json.dumps({"train_file": None, "block_size": 32, "seed": 0}))
    (folder / "transfer_args.json").write_text(json.dumps({"teacher": "t", "student": "s"}))
    (folder / "config.json").write_text("{}")
    args = argparse.Namespace(output_dir=str(folder), resume_from_checkpoint="latest", overwrite_output_dir=False,
                              family="softmax", model=[], model_name_or_path=str(folder), train_file=None,
                              block_size=32, seed=0)
    with pytest.raises(ValueError, match=r"holds a run of transfer_attention.py .*not a run of train_lm.py"):
        check_output_dir(args, "train_lm")


def test_resuming_a_finished_run_without_checkpoints_is_refused(tmp_path, corpus):
    out = tmp_path / "run"
    train(out, corpus, *tiny_model("softmax"), "--checkpointing_steps", "0")
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"already holds files: a run of train_lm.py .*; start over with "
                                         r"--overwrite_output_dir"):  # no resume offered: nothing to resume
        train(out, corpus, *tiny_model("softmax"), "--checkpointing_steps", "0")
    with pytest.raises(ValueError, match=r"finished and left no checkpoint to resume .*train from scratch over that "
                                         r"model. Nothing was written; to train that model further, pass "
                                         r"--model_name_or_path .*run --output_dir run-continued"):
        train(out, corpus, *tiny_model("softmax"), "--checkpointing_steps", "0", "--resume_from_checkpoint", "latest")
    assert snapshot(out) == before


def test_a_checkpoint_resumes_only_in_the_folder_of_its_run(tmp_path, corpus):
    first = tmp_path / "first"
    train_new(first, corpus)
    with pytest.raises(ValueError, match=r"is not a checkpoint of the run in --output_dir .*second: a checkpoint "
                                         r"continues only the run that wrote it"):
        train_new(tmp_path / "second", corpus, "--resume_from_checkpoint", first / "checkpoints" / "step_2")
    assert not (tmp_path / "second").exists()


def test_overwrite_never_empties_a_folder_that_is_not_a_run(tmp_path, corpus, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    (mine / "data").mkdir()
    (mine / "data" / "train.txt").write_text("my data")
    before = snapshot(mine)
    with pytest.raises(ValueError, match=r"--overwrite_output_dir: --output_dir .*mine holds files that are not a run "
                                         r"\(data, notes.txt; no run_args.json\), so it is not a run and is not "
                                         r"emptied"):
        train_new(mine, corpus, "--overwrite_output_dir")
    assert snapshot(mine) == before
    monkeypatch.chdir(mine)  # `--output_dir . --overwrite_output_dir` in one's working folder
    with pytest.raises(ValueError, match=r"so it is not a run and is not emptied"):
        train_new(".", corpus, "--overwrite_output_dir")
    assert snapshot(mine) == before


def test_overwrite_deletes_only_what_the_run_wrote(tmp_path, corpus):
    out = tmp_path / "run"
    train_new(out, corpus, "--max_train_steps", "3")
    record = json.loads((out / RUN_ARGS_FILE).read_text())
    assert record["script"] == "train_lm" and record["model_type"] == "attnzoo_softmax"
    assert record["started_from"] is None
    assert {"checkpoints", "config.json", "model.safetensors", "metrics.jsonl", "README.md"} <= set(record["outputs"])
    assert set(record["outputs"]) >= {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("written by hand after the run")
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"--overwrite_output_dir: --output_dir .*run holds a run of train_lm.py "
                                         r"\(family softmax, a new model\) and also files that run did not write "
                                         r"\(notes.txt\); nothing was deleted"):
        train_new(out, corpus, "--overwrite_output_dir")
    assert snapshot(out) == before
    (out / "notes.txt").unlink()
    (out / "checkpoints" / "my_notes.txt").write_text("inside the run's checkpoints")
    with pytest.raises(ValueError, match=r"also files that run did not write \(checkpoints/my_notes.txt\)"):
        train_new(out, corpus, "--overwrite_output_dir")
    (out / "checkpoints" / "my_notes.txt").unlink()
    train_new(out, corpus, "--overwrite_output_dir")
    assert not (out / "checkpoints" / "step_3").exists()


def test_overwrite_never_deletes_a_run_of_another_command_or_the_model_it_starts_from(tmp_path, converted, corpus):
    before = snapshot(converted)
    with pytest.raises(ValueError, match=r"--overwrite_output_dir: --output_dir .*conv holds a run of "
                                         r"attnzoo.convert.llama .*which this command did not make; "
                                         r"--overwrite_output_dir starts over only a run of train_lm.py. Nothing was "
                                         r"deleted"):
        train(converted, corpus, "--model_name_or_path", converted, "--overwrite_output_dir")
    assert snapshot(converted) == before
    run = tmp_path / "run"
    train_new(run, corpus)
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"--overwrite_output_dir would delete .*run, the model this run starts from"):
        train(run, corpus, "--model_name_or_path", run, "--overwrite_output_dir")
    assert snapshot(run) == before


def test_settings_of_a_resumed_run_are_compared_as_settings(tmp_path, corpus):
    out = tmp_path / "run"
    train_new(out, corpus)
    reordered = ["--family", "softmax", "--model", *reversed(tiny_model("softmax")[3:])]
    train(out, corpus, *reordered, "--checkpointing_steps", "1", "--resume_from_checkpoint", "latest",
          "--max_train_steps", "3")  # the same --model values in another order: the same run
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint .*step_9 does not exist.*Nothing was written"):
        train_new(tmp_path / "new", corpus, "--resume_from_checkpoint", tmp_path / "new" / "checkpoints" / "step_9")
    assert not (tmp_path / "new").exists()


def test_a_family_that_is_not_the_models_is_refused(tmp_path, converted, corpus):
    """--family configures a new model; with --model_name_or_path it was ignored and recorded wrongly."""
    with pytest.raises(ValueError, match=r"--family lara configures a new model, but --model_name_or_path .*conv is "
                                         r"a attnzoo_performer model"):
        train(tmp_path / "out", corpus, "--model_name_or_path", converted, "--family", "lara")
    assert not (tmp_path / "out").exists()


def test_a_run_of_another_script_is_not_resumed(tmp_path, corpus):
    """A translation run's folder, recorded by train_translation.py, is not train_lm's to resume."""
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_ARGS_FILE).write_text(json.dumps({"script": "train_translation", "model_type": "attnzoo_softmax",
                                                 "started_from": None, "outputs": [RUN_ARGS_FILE]}))
    with pytest.raises(ValueError, match=r"holds a run of train_translation.py \(family softmax, a new model\), not "
                                         r"a run of train_lm.py to resume"):
        train_new(out, corpus, "--resume_from_checkpoint", "latest")


def classification_table(folder: Path) -> Path:
    rows = ["text,label"] + [f"{'good great fine' if i % 2 else 'bad awful poor'} item {i},"
                             f"{'positive' if i % 2 else 'negative'}" for i in range(24)]
    path = folder / "labels.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def finetune(base, table, out, *extra):
    return run_script("finetune_text_classification", [
        "--model_name_or_path", base, "--train_file", table, "--output_dir", out, "--max_steps", "2",
        "--per_device_train_batch_size", "8", "--report_to", "none", "--use_cpu", "--seed", "0", *extra])


def test_finetuning_into_a_language_model_run_is_refused_and_loses_nothing(tmp_path, corpus):
    lm = tmp_path / "lm"
    train_new(lm, corpus)
    before = snapshot(lm)
    with pytest.raises(ValueError, match=r"--output_dir .*lm already holds files: a run of train_lm.py \(family "
                                         r"softmax, a new model\). A new run there would overwrite and mix with them; "
                                         r"pick another --output_dir; to train the model it holds, keep it and write "
                                         r"the run elsewhere"):
        finetune(lm, classification_table(tmp_path), lm)
    assert snapshot(lm) == before


@pytest.mark.slow
# The Trainer's resume reads the checkpoint's config.json through the base PreTrainedConfig, which takes attnzoo's own
# `rope_scaling` field for its deprecated name of `rope_parameters` and warns (transformers 5.24).
@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_finetuning_records_its_run_resumes_it_and_overwrites_only_it(tmp_path, corpus):
    lm = tmp_path / "lm"
    train_new(lm, corpus)
    table = classification_table(tmp_path)
    out = tmp_path / "classifier"
    finetune(lm, table, out, "--save_strategy", "steps", "--save_steps", "1")
    record = json.loads((out / RUN_ARGS_FILE).read_text())
    assert record["script"] == "finetune_text_classification" and record["started_from"] == str(lm)
    assert {"checkpoint-1", "checkpoint-2", "config.json", "model.safetensors"} <= set(record["outputs"])
    with pytest.raises(ValueError, match=r"already holds files: a run of finetune_text_classification.py .*resume "
                                         r"that run with --resume_from_checkpoint latest, start over with "
                                         r"--overwrite_output_dir"):
        finetune(lm, table, out)
    finetune(lm, table, out, "--resume_from_checkpoint", "latest", "--max_steps", "3", "--save_strategy", "no")
    finetune(lm, table, out, "--overwrite_output_dir", "--save_strategy", "no")
    assert not (out / "checkpoint-2").exists()


def test_evaluate_replaces_only_its_own_results_file(tmp_path, corpus):
    from attnzoo.tokenization import byte_level_tokenizer
    from tests.models.test_hf_workflow import tiny_lm

    folder = tmp_path / "model"
    tiny_lm("softmax").save_pretrained(folder)
    byte_level_tokenizer(128).save_pretrained(folder)
    evaluate = load_script("evaluate")
    argv = ["--model_name_or_path", str(folder), "--train_file", str(corpus), "--block_size", "32",
            "--max_eval_batches", "1"]
    mine = tmp_path / "mine.json"
    for own in ({"my": "numbers"}, {"model": "gpt2", "task": "lm", "my_notes": "kept"}):
        mine.write_text(json.dumps(own))
        with pytest.raises(ValueError, match=r"--output_file .*mine.json already exists and is not a results file "
                                             r"of this script; it is left as it is"):
            evaluate.main([*argv, "--output_file", str(mine)])
        assert json.loads(mine.read_text()) == own
    results = tmp_path / "new" / "folder" / "results.json"  # its folders are made
    evaluate.main([*argv, "--output_file", str(results)])
    evaluate.main([*argv, "--output_file", str(results)])  # its own file: replaced
    assert json.loads(results.read_text())["task"] == "lm" and json.loads(results.read_text())["script"] == "evaluate"


def test_a_train_file_that_is_not_a_regular_file_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"--train_file /dev/null is not a regular file \(a device, pipe or "
                                         r"socket\)"):
        train_new(tmp_path / "run", "/dev/null")
    assert not (tmp_path / "run").exists()


def test_a_truncated_weights_file_is_named_by_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.models.test_hf_workflow import tiny_lm

    tiny_lm("softmax").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors \(its tensors need \d+ bytes, but the file has \d+\): the "
                                         r"weights are damaged \(cut short or corrupted"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    weights.write_bytes(weights.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"model.safetensors \(its header says \d+ bytes of metadata"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
