"""torch.compile: every family's causal LM compiles as one graph (fullgraph=True) in training and in evaluation,
computes what eager computes, and does not recompile for a second batch of the same shape. The training scripts'
--torch_compile run saves weights an uncompiled model loads, and resumes from its checkpoints.

Whether a model traces whole (dynamo), with its backward (AOTAutograd), and computes what eager computes is checked
for every family with the `aot_eager` backend, which runs the traced forward and backward graphs with eager kernels:
everything torch.compile does to attnzoo's code (its compile-only branches included) except inductor's code
generation. Inductor, which takes minutes per model on two CPU cores (most of it writing and compiling C++ kernels),
compiles the family with the most machinery in its training graph (the Reformer: activation-checkpointed reversible
blocks, LSH's bucket sort and gathers, local chunks) against eager, and the training script's compiled run.
(tests/models/test_static_cache.py compiles the decoding steps of softmax, RA, FAVOR+, LARA and the Reformer with
inductor against eager.)

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


def compiled_matches_eager(model, backend: str, evaluation: bool) -> None:
    """`model` compiled whole with `backend` gives eager's training loss and gradients (the same draws: same seed),
    in one graph that a second batch of the same shape does not recompile, and (`evaluation`) eager's logits in
    evaluation."""
    torch._dynamo.reset()
    counters.clear()
    # fallback_random: inductor draws with eager's generator, so the random-feature families draw what eager draws
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
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

        if evaluation:
            model.eval()
            with torch.no_grad():
                torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits,
                                           rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_model_matches_eager_in_one_graph(family):
    compiled_matches_eager(tiny_causal_lm(family).train(), "aot_eager", evaluation=True)


def test_inductor_compiled_reversible_lsh_model_matches_eager():
    """The Reformer under inductor: the reversible stack's blocks activation-checkpointed (their forward compiled
    twice, the second time inside the backward), LSH's bucket sort and gathers, the local chunks (the ops' naive path
    under compile). Its evaluation graph holds the same attention ops without the checkpoints; the aot_eager test
    above compares it for every family."""
    compiled_matches_eager(tiny_causal_lm("reformer").train(), "inductor", evaluation=False)


def test_torch_compile_training_run_saves_plain_weights_and_resumes(tmp_path):
    """The script's compiled run (inductor, what --torch_compile gives a user): a reversible stack, activation-
    checkpointed under compile, with dropout, so that the resumed run matches only if the random state is restored.
    Its attention is softmax: the attention's own compiled code is the tests' above; the script's handling of the
    compiled model (saving, loading, resuming) is the same for every family."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:1350])

    def train(out, *extra):
        return ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "8", "--checkpointing_steps", "4",
                "--heldout_fraction", "0.2", "--max_eval_batches", "1", "--output_dir", out, "--torch_compile",
                *tiny_model("softmax", "hidden_dropout_prob=0.1", "reversible=true"),
                "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3",
                "--sample_tokens", "0", *QUIET, *extra]

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
