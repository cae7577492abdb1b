"""Bad data files and empty scores: refused with the file and the fix, never trained on or reported as a result."""

import argparse

import pytest

from attnzoo.training.metrics import bleu_scores
from tests.scripts_helpers import QUIET, english_text, load_script, run_script, tiny_model

STEPS = ["--block_size", "32", "--max_train_steps", "2", "--per_device_train_batch_size", "4", "--sample_tokens", "0",
         *QUIET]


def test_a_binary_file_given_as_text_stops_the_run_naming_the_line(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(english_text()[:3000] + b"\n\xff\xfe\x00\x81 binary\n" + english_text()[:3000])
    with pytest.raises(ValueError, match=r"weights.bin:\d+: not UTF-8 text"):
        run_script("train_lm", ["--train_file", binary, "--output_dir", tmp_path / "run", *tiny_model("softmax"),
                                *STEPS])
    assert not (tmp_path / "run").exists()
    # with --skip_bad_examples the line is dropped and the run goes on
    run_script("train_lm", ["--train_file", binary, "--output_dir", tmp_path / "run", *tiny_model("softmax"), *STEPS,
                            "--skip_bad_examples"])


def test_a_folder_given_as_a_file_says_it_is_a_folder(tmp_path):
    with pytest.raises(ValueError, match=r"--train_file .* is a folder; pass a text file"):
        run_script("train_lm", ["--train_file", tmp_path, "--output_dir", tmp_path / "run", *tiny_model("softmax"),
                                *STEPS])


@pytest.mark.parametrize("hypotheses, references, message", [
    ([], [], r"no sentence pairs to score"),
    (["ein Haus", "ja"], ["", "  "], r"all 2 references are empty"),
])
def test_bleu_refuses_what_is_not_a_score(hypotheses, references, message):
    with pytest.raises(ValueError, match=message):
        bleu_scores(hypotheses, references)


def test_blank_labels_are_refused_instead_of_becoming_a_class(tmp_path):
    script = load_script("finetune_text_classification")
    rows = ["text,label"] + [f"item {i},{'positive' if i % 2 else 'negative'}" for i in range(10)] + ["item x,"]
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    args = argparse.Namespace(train_file=str(tmp_path / "data.csv"), validation_file=None, text_column="text",
                              label_column="label", validation_split=0.2)
    with pytest.raises(ValueError, match=r"data.csv: 1 row\(s\) have no 'label' \(first: data row 11\)"):
        script.load_table(args)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_an_empty_validation_file_is_named(tmp_path, suffix):
    train = tmp_path / f"train{suffix}"
    train.write_text("x" if suffix == ".txt" else '{"text": "x"}\n')
    empty = tmp_path / f"validation{suffix}"
    empty.write_text("")
    with pytest.raises(ValueError, match=rf"--validation_file .*validation{suffix} is empty"):
        run_script("train_lm", ["--train_file", train, "--validation_file", empty, "--output_dir", tmp_path / "run",
                                *tiny_model("softmax"), *STEPS])
