"""Arguments that ran to a silent failure or a message naming the wrong thing (issue 45): train_lm.py with an infinite
--passkey_answer_weight trained nothing and exited 0; evaluate.py on a model folder without a tokenizer said that
sentencepiece or tiktoken was not installed, and --num_fewshot -1 ended in a bare AssertionError from lm-eval. Each is
refused up front with a message naming the argument and the fix, and leaves every file byte for byte as it was."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM, ZooSoftmaxForConditionalGeneration
from attnzoo.evaluation.harness import LOCAL_TAG
from attnzoo.tokenization import byte_level_tokenizer
from tests.scripts_helpers import QUIET, english_text, run_script, tiny_model

HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
TINY = dict(vocab_size=260, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=1)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(english_text()[:4_000])
    return path


def saved(folder: Path, model_class, tokenizer: bool) -> Path:
    model_class(ZooSoftmaxConfig(**TINY)).save_pretrained(folder)
    if tokenizer:
        byte_level_tokenizer().save_pretrained(folder)
    return folder


# -- train_lm.py --passkey_answer_weight --------------------------------------------------------------------------
@pytest.mark.parametrize("weight", ["inf", "Infinity", "1e309", "-inf", "nan", "0", "-1"])
def test_train_lm_refuses_a_passkey_answer_weight_that_is_not_finite_and_positive(tmp_path, corpus, weight):
    before = snapshot(tmp_path)
    out = tmp_path / "run"
    shown = str(float(weight))
    with pytest.raises(ValueError, match=rf"--passkey_answer_weight={re.escape(shown)} is invalid: set a finite, "
                                         r"positive weight of the answer tokens' loss \(1: as any other token"):
        run_script("train_lm", ["--train_file", corpus, "--output_dir", out, "--block_size", "128",
                                "--max_train_steps", "1", "--per_device_train_batch_size", "2",
                                "--passkey_fraction", "0.5", f"--passkey_answer_weight={weight}",  # "-inf" as a value
                                "--sample_tokens", "0", *QUIET, *tiny_model("softmax")])
    assert not out.exists() and snapshot(tmp_path) == before


# -- evaluate.py: a model folder without a tokenizer ---------------------------------------------------------------
def test_evaluate_names_the_model_folder_that_holds_no_tokenizer_and_the_fix_works(tmp_path, corpus):
    folder = saved(tmp_path / "model", ZooSoftmaxForCausalLM, tokenizer=False)
    data = ["--train_file", str(corpus), "--block_size", "32", "--max_eval_batches", "1"]
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"the model folder {re.escape(str(folder))} holds no tokenizer \(none of "
                                         r"tokenizer\.json, tokenizer_config\.json\), and the bits/dim evaluation.*"
                                         r"pass --tokenizer_name NAME_OR_FOLDER.*tokenizer\.save_pretrained"):
        run_script("evaluate", ["--model_name_or_path", folder, "--output_file", tmp_path / "results.json", *data])
    assert snapshot(tmp_path) == before

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(ValueError, match=rf"--tokenizer_name {re.escape(str(elsewhere))} holds no tokenizer"):
        run_script("evaluate", ["--model_name_or_path", folder, "--tokenizer_name", elsewhere, *data])
    byte_level_tokenizer().save_pretrained(tmp_path / "tokenizer")
    found = run_script("evaluate", ["--model_name_or_path", folder, "--tokenizer_name", tmp_path / "tokenizer", *data])
    assert found["task"] == "lm" and found["sequences"] > 0
    assert {folder.name / path: content for path, content in snapshot(folder).items()} == {
        path: content for path, content in before.items() if path.parts[0] == folder.name}  # bits/dim writes nothing


def test_evaluate_names_a_translation_model_folder_that_holds_no_tokenizer(tmp_path):
    folder = saved(tmp_path / "model", ZooSoftmaxForConditionalGeneration, tokenizer=False)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"the model folder {re.escape(str(folder))} holds no tokenizer.*the BLEU "
                                         r"evaluation.*--tokenizer_name"):
        run_script("evaluate", ["--model_name_or_path", folder, "--output_file", tmp_path / "results.json"])
    assert snapshot(tmp_path) == before


# -- evaluate.py --num_fewshot ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("lm_eval", ["installed", "missing"])
def test_evaluate_refuses_a_negative_num_fewshot_before_lm_eval_runs(tmp_path, monkeypatch, lm_eval):
    if lm_eval == "installed" and not HAVE_LM_EVAL:
        pytest.skip("lm-eval is an optional extra; the check without it is the 'missing' case")
    if lm_eval == "missing":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    folder = saved(tmp_path / "model", ZooSoftmaxForCausalLM, tokenizer=True)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"--num_fewshot=-1 is invalid: set the number of examples shown before each "
                                         r"question \(0: none\), or leave it out"):
        run_script("evaluate", ["--model_name_or_path", folder, "--lm_eval_tasks", LOCAL_TAG, "--num_fewshot", "-1",
                                "--lm_eval_limit", "2", "--output_file", tmp_path / "results.json"])
    assert snapshot(tmp_path) == before
