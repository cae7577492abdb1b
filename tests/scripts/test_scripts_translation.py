"""scripts/train_translation.py end to end on a small offline en-de corpus: shared BPE, encoder-decoder of each
family, beam search, checkpoint averaging, BLEU with signatures in the results and the model card, evaluate.py,
exact resume."""


import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from attnzoo.training.checkpoints import load_checkpoint_weights
from tests.scripts_helpers import (
    FAMILIES,
    QUIET,
    assert_identical_weights,
    copy_interrupted_run,
    results,
    run_script,
    tiny_model,
    weights,
    write_parallel_corpus,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_parallel_corpus(tmp_path_factory.mktemp("corpus"), pairs=600)


def translation_args(corpus, out, family, *extra):
    encoder = ["attn_layers=[favor]", "decoder_attn_layers=[full]"] if family == "performer" else []
    return ["--train_file", corpus["train"], "--validation_file", corpus["validation"], "--test_file",
            corpus["test"], "--bpe_vocab_size", "400", "--max_source_length", "32", "--max_target_length", "32",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--learning_rate", "3e-3",
            "--num_warmup_steps", "2", "--max_eval_samples", "12", "--generation_max_length", "12",
            "--output_dir", out, *tiny_model(family, *encoder), *QUIET, *extra]


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_averages_checkpoints_and_reports_bleu(tmp_path, corpus, family):
    out = tmp_path / "run"
    found = run_script("train_translation", translation_args(
        corpus, out, family, "--max_train_steps", "9", "--checkpointing_steps", "3",
        "--average_last_checkpoints", "2", "--logging_steps", "3"))
    assert found["train_steps"] == 9 and found["eval_split"] == "test" and found["num_sentences"] == 12
    assert found["averaged_checkpoints"] == 2
    bleu = found["bleu"]
    assert set(bleu) == {"sacrebleu", "sacrebleu_intl", "sacrebleu_intl_uncased", "tokenized_bleu"}
    assert "tok:13a" in bleu["sacrebleu"]["signature"] and "case:lc|eff:no|tok:intl" in \
        bleu["sacrebleu_intl_uncased"]["signature"] and "compound-split" in bleu["tokenized_bleu"]["signature"]
    assert results(out)["eval_bleu"] == bleu["sacrebleu"]["score"]

    # The saved model is the mean of the last two checkpoints (steps 6 and 9), not the last weights.
    step6, step9 = (load_checkpoint_weights(out / "checkpoints" / f"step_{s}") for s in (6, 9))
    saved = weights(out)
    for key in saved:
        if saved[key].is_floating_point():
            torch.testing.assert_close(saved[key], (step6[key] + step9[key]) / 2, rtol=0, atol=1e-6)
    assert any(not torch.equal(saved[k], step9[k]) for k in saved)

    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert model.config.model_type == f"attnzoo_{family}" and model.generation_config.num_beams == 4
    assert model.generation_config.length_penalty == 0.6
    if family == "performer":
        assert model.config.attn_layers == ["favor"] and model.config.decoder_attn_layers == ["full"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "Cannot open the file"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text  # lossless BPE
    assert tokenizer(text).input_ids[-1] == tokenizer.eos_token_id
    out_ids = model.generate(**tokenizer([text], return_tensors="pt"), max_new_tokens=5)
    assert out_ids.shape[0] == 1

    card = (out / "README.md").read_text()
    assert "type: bleu" in card and bleu["sacrebleu"]["signature"] in card and "pipeline_tag: translation" in card
    hypotheses = (out / "test_translations.txt").read_text().splitlines()
    assert len(hypotheses) == 12

    evaluated = run_script("evaluate", ["--model_name_or_path", out, "--split", "test"])
    assert evaluated["task"] == "translation" and evaluated["num_sentences"] == 12
    assert evaluated["bleu"] == pytest.approx(bleu["sacrebleu"]["score"])


def test_resume_gives_identical_weights(tmp_path, corpus):
    args = ["--max_train_steps", "8", "--checkpointing_steps", "4", "--gradient_accumulation_steps", "2",
            "--max_eval_samples", "4", "--model", "hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2",
            "intermediate_size=64", "hidden_dropout_prob=0.1"]
    run_script("train_translation", translation_args(corpus, tmp_path / "full", "softmax", *args))
    resumed = tmp_path / "resumed"
    copy_interrupted_run(tmp_path / "full", resumed, 4, "tokenizer")  # with the BPE of the interrupted run
    run_script("train_translation", [*translation_args(corpus, resumed, "softmax", *args),
                                     "--resume_from_checkpoint", "latest"])
    assert_identical_weights(weights(tmp_path / "full"), weights(resumed))


def test_bad_arguments_say_what_to_change(tmp_path, corpus):
    base = translation_args(corpus, tmp_path / "o", "softmax", "--max_train_steps", "4")
    cases = [
        (["--average_last_checkpoints", "3"], "checkpointing_steps"),
        (["--average_last_checkpoints", "3", "--checkpointing_steps", "1", "--checkpoints_total_limit", "2"],
         "checkpoints_total_limit"),
        (["--target_lang", "en"], "same"),
        (["--target_lang", "fr"], "source_lang/--target_lang"),
        (["--label_smoothing", "1.5"], "label_smoothing"),
        (["--bpe_vocab_size", "100"], "bpe_vocab_size"),
        (["--validation_file", tmp_path / "missing.jsonl"], "not found"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            run_script("train_translation", [*base, *extra])
