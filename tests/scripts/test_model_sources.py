"""--model_name_or_path (and a converter's SRC) that is not a saved model: the error says what the path holds and
what to pass instead, not transformers' "Repo id must be ..." or "Should have a model_type"."""

import pytest

from tests.scripts.test_run_folders import STEPS
from tests.scripts_helpers import QUIET, run_script, tiny_model


@pytest.fixture
def run_folder(tmp_path):
    from tests.scripts_helpers import english_text

    corpus = tmp_path / "text.txt"
    corpus.write_bytes(english_text()[:20_000])
    out = tmp_path / "run"
    run_script("train_lm", ["--train_file", corpus, "--output_dir", out, *tiny_model("softmax"), *STEPS])
    return out


def test_evaluate_names_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match=r"--model_name_or_path .*runs/nothing-here: no such folder"):
        run_script("evaluate", ["--model_name_or_path", tmp_path / "runs" / "nothing-here"])


def test_evaluate_on_a_training_checkpoint_points_to_the_model(run_folder):
    checkpoint = run_folder / "checkpoints" / "step_2"
    with pytest.raises(ValueError, match=rf"is a training checkpoint .*not a saved model. The run's model is in "
                                          rf"{run_folder}"):
        run_script("evaluate", ["--model_name_or_path", checkpoint])


def test_a_damaged_weights_file_is_named(run_folder):
    weights = run_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model.safetensors is damaged"):
        run_script("evaluate", ["--model_name_or_path", run_folder])


def test_training_from_a_missing_model_folder_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"--model_name_or_path .*missing/model: no such folder"):
        run_script("train_lm", ["--model_name_or_path", tmp_path / "missing" / "model", "--output_dir",
                                tmp_path / "run", "--max_train_steps", "1", *QUIET])


def test_a_converter_with_a_missing_source_says_so(tmp_path):
    from attnzoo.convert import gpt2

    with pytest.raises(ValueError, match=r"SRC .*no-gpt2: no such folder"):
        gpt2.main([str(tmp_path / "no-gpt2"), str(tmp_path / "dst"), "--family", "softmax"])


def test_every_converter_with_a_missing_source_says_so(tmp_path):
    from attnzoo.convert import reformer_from_transformers, vit

    with pytest.raises(ValueError, match=r"SRC .*no-reformer: no such folder"):
        reformer_from_transformers.main([str(tmp_path / "no-reformer"), str(tmp_path / "dst")])
    with pytest.raises(ValueError, match=r"SRC .*no-vit.pth: no such file or folder"):
        vit.main([str(tmp_path / "no-vit.pth"), str(tmp_path / "dst2"), "--family", "softmax"])
