"""torch.compile: every family's causal LM compiles as one graph (fullgraph=True) in training and in evaluation,
computes what eager computes, and does not recompile for a second batch of the same shape. The training scripts'
--torch_compile run saves weights an uncompiled model loads, and resumes from its checkpoints.

Compiling takes tens of seconds per model on two cores, so these are marked slow."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

import attnzoo  # noqa: F401  (registers the Auto classes)
from tests.attention.helpers import named
from tests.scripts_helpers import (
    FAMILIES,
    QUIET,
    copy_interrupted_run,
    english_text,
    max_weight_difference,
    results,
    run_script,
    tiny_model,
    weights,
)

pytestmark = pytest.mark.slow

FAMILY_SETTINGS = {
    "reformer": dict(lsh_chunk_length=8, local_chunk_length=8),
    "performer": dict(num_random_features=16, linear_attention_chunk_size=16),
    "lara": dict(lara_num_samples=4, lara_chunk_size=8),
}


def tiny_causal_lm(family: str) -> torch.nn.Module:
    config = AutoConfig.for_model(f"attnzoo_{family}", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                                  is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  **FAMILY_SETTINGS.get(family, {}))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def loss_and_gradients(model, ids, seed):
    model.zero_grad()
    torch.manual_seed(seed)  # the same random features / hash rotations / samples in both runs
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name.removeprefix("_orig_mod."): p.grad.clone()
                           for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_model_matches_eager_in_one_graph(family):
    torch._dynamo.reset()
    counters.clear()
    model = tiny_causal_lm(family).train()
    # fallback_random: inductor draws with eager's generator, so the random-feature families draw what eager draws
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
        eager_loss, eager_grads = loss_and_gradients(model, ids, seed=5)
        compiled_loss, compiled_grads = loss_and_gradients(compiled, ids, seed=5)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
        assert compiled_grads.keys() == eager_grads.keys()
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=named(name))

        graphs_after_first_batch = counters["stats"]["unique_graphs"]
        loss_and_gradients(compiled, ids.flip(0), seed=6)  # a new batch, same shape: no new graph
        assert counters["stats"]["unique_graphs"] == graphs_after_first_batch == 1

        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits,
                                       rtol=1e-4, atol=1e-5)


def test_torch_compile_training_run_saves_plain_weights_and_resumes(tmp_path):
    """Reformer is the family with the most machinery under compile: the reversible stack is activation-checkpointed
    there, LSH buckets are sorted, the windowed attention runs its reference form."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:1350])

    def train(out, *extra):
        return ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "8", "--checkpointing_steps", "4",
                "--heldout_fraction", "0.2", "--max_eval_batches", "1", "--output_dir", out, "--torch_compile",
                *tiny_model("reformer", "hidden_dropout_prob=0.1"), "--per_device_train_batch_size", "4",
                "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3", "--sample_tokens", "0", *QUIET,
                *extra]

    run_script("train_lm", train(tmp_path / "full"))
    saved = weights(tmp_path / "full")
    assert not any(key.startswith("_orig_mod.") for key in saved)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    assert set(loaded.state_dict()) >= set(saved)

    resumed = tmp_path / "resumed"
    copy_interrupted_run(tmp_path / "full", resumed, 4)
    run_script("train_lm", train(resumed, "--resume_from_checkpoint", "latest"))
    # The resumed process compiles its own kernels; the weights agree to float rounding, not always bit for bit.
    assert max_weight_difference(saved, weights(resumed)) < 1e-6
    assert results(resumed)["eval_bits_per_dim"] == pytest.approx(results(tmp_path / "full")["eval_bits_per_dim"],
                                                                  abs=1e-5)
