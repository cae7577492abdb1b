"""The pass-key tasks for lm-eval (attnzoo/evaluation/tasks/passkey): `lm_eval`'s own `hf` model, given lengths
through `--metadata`, sees the prompts `attnzoo.evaluation.passkey.passkey_accuracy` builds and scores them the same
way, continuation for continuation; the distance variant puts the key where it is asked to."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch

from attnzoo import ZooHybridConfig, ZooHybridForCausalLM
from attnzoo.evaluation import harness
from attnzoo.evaluation.passkey import is_correct, passkey_accuracy, passkey_prompt
from attnzoo.tokenization import byte_level_tokenizer

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason=f"lm-eval is an optional extra: {harness.INSTALL_HINT}")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny byte-level model with a windowed LSH layer and a global layer without positions (weights drawn wide,
    so that continuations depend on the prompt), saved with its tokenizer."""
    tokenizer = byte_level_tokenizer(512)
    config = ZooHybridConfig(vocab_size=len(tokenizer), max_position_embeddings=512, is_decoder=True, hidden_size=32,
                             num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, initializer_range=0.3,
                             hidden_dropout_prob=0.0, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             attn_layers=["lsh_window", "full"], far_positions=["rotary", "none"],
                             position_embedding_type="rotary", lsh_shared_qk=False, lsh_chunk_length=16,
                             window_size=32, num_sink_tokens=4)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("passkey_model")
    ZooHybridForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


@pytest.fixture(autouse=True)
def offline_on_one_thread(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)


@needs_lm_eval
def test_lm_eval_scores_the_prompts_passkey_accuracy_scores(saved_model):
    folder, tokenizer = saved_model
    lengths, depths, trials = [300, 400], [0.0, 1.0], 2
    results = harness.run(folder, ["attnzoo_passkey"], log_samples=True, bootstrap_iters=0,
                          metadata={"max_seq_lengths": lengths, "depths": depths, "trials": trials})
    samples = sorted(results["samples"]["attnzoo_passkey"], key=lambda s: s["doc_id"])
    assert len(samples) == len(lengths) * len(depths) * trials
    model = ZooHybridForCausalLM.from_pretrained(folder).eval()
    ours = passkey_accuracy(model, tokenizer, lengths, depths, trials=trials, batch_size=1, samples=trials)
    # the same cells in the same order (length, then depth, then trial), the same prompts and continuations
    expected = [(cell["length"], cell["depth"], t, continuation) for cell in ours["cells"]
                for t, continuation in enumerate(cell["samples"])]
    for (length, depth, trial, continuation), theirs in zip(expected, samples, strict=True):
        prompt = passkey_prompt(tokenizer, length, depth, random.Random(f"0:{trial}"))
        assert theirs["doc"]["length"] == length and theirs["doc"]["passkey"] == prompt.passkey
        assert tokenizer(theirs["doc"]["context"])["input_ids"] == prompt.input_ids
        assert theirs["resps"][0][0] == continuation.split("\n")[0]
        assert theirs["acc"] == float(is_correct(continuation, prompt.passkey))
    mean = sum(cell["correct"] for cell in ours["cells"]) / len(samples)
    assert results["results"]["attnzoo_passkey"]["acc,none"] == pytest.approx(mean)


@needs_lm_eval
def test_the_distance_task_puts_the_key_that_far_from_the_end(saved_model):
    folder, tokenizer = saved_model
    results = harness.run(folder, ["attnzoo_passkey_distance"], log_samples=True, bootstrap_iters=0,
                          metadata={"max_seq_lengths": [400], "distances": [100, 200], "trials": 1})
    documents = [s["doc"] for s in sorted(results["samples"]["attnzoo_passkey_distance"], key=lambda s: s["doc_id"])]
    assert [d["distance"] for d in documents] == [100, 200]
    for document in documents:
        context = document["context"]
        key_line = context.index(f"\nThe pass key is {document['passkey']}")  # the key line starts at its newline
        assert len(context) - key_line == document["distance"]  # bytes: one token each


@needs_lm_eval
def test_the_evaluate_script_passes_the_lengths_to_the_tasks(saved_model, tmp_path):
    from tests.scripts_helpers import run_script

    folder, _ = saved_model
    out = tmp_path / "passkey.json"
    run_script("evaluate", ["--model_name_or_path", folder, "--model_card", "none", "--lm_eval_tasks",
                            "attnzoo_passkey", "--lm_eval_metadata", '{"max_seq_lengths": [300], "depths": [0.5], '
                            '"trials": 3}', "--output_file", out])
    found = json.loads(out.read_text())
    assert [(row["task"], row["metric"], row["samples"]) for row in found["lm_eval"]] == [("attnzoo_passkey", "acc", 3)]


def test_the_tasks_can_leave_out_the_task_description_as_training_sequences_do(saved_model):
    """A model trained with --passkey_fraction saw prompts without the opening description; metadata
    task_description=false gives it those (the builders are called as lm-eval calls them)."""
    from attnzoo.evaluation.tasks.passkey.passkey_tasks import passkey_distance_documents, passkey_documents

    folder, tokenizer = saved_model
    plain = passkey_documents(pretrained=str(folder), max_seq_lengths=[300], depths=[0.5], trials=2,
                              task_description=False)["test"]
    for trial, document in enumerate(plain):
        prompt = passkey_prompt(tokenizer, 300, 0.5, random.Random(f"0:{trial}"), task_description=False)
        assert tokenizer(document["context"])["input_ids"] == prompt.input_ids
        assert "important info" not in document["context"]
    far = passkey_distance_documents(pretrained=str(folder), max_seq_lengths=[300], distances=[100, 250], trials=1,
                                     task_description=False)["test"]
    for document, distance in zip(far, [100, 250], strict=True):
        context = document["context"]
        assert "important info" not in context and document["distance"] == distance
        assert len(context) - context.index(f"\nThe pass key is {document['passkey']}") == distance
    with pytest.raises(ValueError, match="task_description='no' in --metadata"):
        passkey_documents(pretrained=str(folder), task_description="no")


def test_the_tasks_take_the_filler_passkey_accuracy_takes(saved_model):
    from attnzoo.evaluation.tasks.passkey.passkey_tasks import passkey_distance_documents, passkey_documents

    folder, tokenizer = saved_model
    shifted = passkey_documents(pretrained=str(folder), max_seq_lengths=[300], depths=[0.5], trials=3,
                                filler="repeat_shifted")["test"]
    for trial, document in enumerate(shifted):
        prompt = passkey_prompt(tokenizer, 300, 0.5, random.Random(f"0:{trial}"), filler="repeat_shifted")
        assert tokenizer(document["context"])["input_ids"] == prompt.input_ids
    assert len({document["context"][:200] for document in shifted}) == 3  # each trial cut elsewhere
    far = passkey_distance_documents(pretrained=str(folder), max_seq_lengths=[300], distances=[100], trials=2,
                                     filler="repeat_shifted")["test"]
    assert far[0]["context"][:150] != far[1]["context"][:150] and far[0]["distance"] == 100
    with pytest.raises(ValueError, match="filler='shifted' in --metadata"):
        passkey_documents(pretrained=str(folder), filler="shifted")
