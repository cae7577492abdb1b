"""GPT-2 -> attnzoo conversion: exact softmax equality, every family converting, saving, reloading with the Auto
classes and generating, the swap error falling as the approximation gets finer, and unmappable sources failing
before anything is written. Sources are tiny GPT-2s with random weights (no network)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, GPT2Model

import attnzoo  # noqa: F401
from attnzoo.convert import gpt2
from attnzoo.convert.common import FAMILIES, ConversionReport
from attnzoo.tokenization import byte_level_tokenizer

VOCAB = 256
FAMILY_OPTIONS = {"softmax": {}, "performer": {"num_random_features": 32}, "ra": {},
                  "lara": {"lara_chunk_size": 8}, "reformer": {"lsh_chunk_length": 8, "local_chunk_length": 8},
                  "hybrid": {"num_random_features": 32}, "window": {"window_size": 8, "num_sink_tokens": 2}}


def tiny_config(**overrides) -> GPT2Config:
    values = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=None,
                  eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Config(**{**values, **overrides})


def tiny_source(model_class=GPT2LMHeadModel, seed: int = 0, peaked: float = 1.0, **overrides):
    """A float64 GPT-2 with random weights; `peaked` scales the query and key weights so attention is far from
    uniform, as in a trained model (with init weights every attention is nearly an average)."""
    torch.manual_seed(seed)
    model = model_class(tiny_config(**overrides)).double().eval()
    blocks = model.transformer.h if model_class is GPT2LMHeadModel else model.h
    with torch.no_grad():
        for block in blocks:
            block.attn.c_attn.weight[:, :2 * model.config.n_embd] *= peaked
    return model


def token_ids(batch=2, length=40, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def saved_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2_source")
    tiny_source(peaked=3.0).float().save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


# -- exact softmax conversion ---------------------------------------------------------------------------------
def test_softmax_conversion_gives_the_source_logits_float64():
    source = tiny_source(peaked=3.0)
    ids = token_ids(length=64)
    model = gpt2.convert(source, "softmax")
    assert type(model).__name__ == "ZooSoftmaxForCausalLM" and model.config.tie_word_embeddings
    with torch.no_grad():
        difference = (model(ids).logits - source(ids).logits).abs().max().item()
    assert difference < 1e-10


def test_base_gpt2_model_converts_to_the_base_decoder():
    source = tiny_source(GPT2Model, peaked=3.0)
    ids = token_ids()
    model = gpt2.convert(source, "softmax")
    assert type(model).__name__ == "ZooSoftmaxModel" and model.config.is_decoder
    with torch.no_grad():
        difference = (model(ids).last_hidden_state - source(ids).last_hidden_state).abs().max().item()
    assert difference < 1e-10


def test_untied_lm_head_and_other_activation_carry_over():
    source = tiny_source(tie_word_embeddings=False, activation_function="relu", layer_norm_epsilon=1e-6)
    with torch.no_grad():
        source.lm_head.weight.normal_()
    model = gpt2.convert(source, "softmax")
    assert not model.config.tie_word_embeddings and model.config.hidden_act == "relu"
    assert model.config.layer_norm_eps == 1e-6
    ids = token_ids()
    with torch.no_grad():
        assert (model(ids).logits - source(ids).logits).abs().max().item() < 1e-10


def test_softmax_conversion_generates_the_same_tokens():
    source = tiny_source(peaked=3.0).float()
    model = gpt2.convert(source, "softmax")
    prompt = token_ids(batch=1, length=5)
    expected = source.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0), expected)


# -- every family ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_converts_saves_reloads_and_generates(family, saved_source, tmp_path):
    dst = tmp_path / family
    options = [f"{k}={v}" for k, v in FAMILY_OPTIONS[family].items()]
    gpt2.main([str(saved_source), str(dst), "--family", family, "--model", *options])
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    tokenizer = AutoTokenizer.from_pretrained(dst)
    assert model.config.model_type == f"attnzoo_{family}"
    assert not model.config.reversible and model.config.position_embedding_type == "learned"
    source = GPT2LMHeadModel.from_pretrained(saved_source)
    # every shared weight carried over
    assert torch.equal(model.model.embed_tokens.weight, source.transformer.wte.weight)
    assert torch.equal(model.model.transformer.positions.table.weight, source.transformer.wpe.weight)
    block, source_block = model.model.transformer.blocks[1], source.transformer.h[1]
    assert torch.equal(block.ffn.fc_in.weight, source_block.mlp.c_fc.weight.t())
    assert torch.equal(block.attn_norm.weight, source_block.ln_1.weight)
    query = source_block.attn.c_attn.weight[:, :32].t()
    attn_query = getattr(block.attn, "q_proj", None) or getattr(block.attn, "query_key", None)
    assert torch.equal(attn_query.weight, query)
    # reloads to the same function, and generates
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    converted = gpt2.convert(source, family, FAMILY_OPTIONS[family])
    converted.eval()
    with torch.no_grad():
        torch.manual_seed(0)
        reloaded_logits = model(ids).logits
        torch.manual_seed(0)
        converted_logits = converted(ids).logits
    assert torch.allclose(reloaded_logits, converted_logits, atol=1e-5)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 6)
    assert isinstance(tokenizer.decode(out[0]), str)


def test_reformer_lsh_layers_share_the_query_projection_and_drop_the_key():
    source = tiny_source()
    report = ConversionReport()
    model = gpt2.convert(source, "reformer", {"attn_layers": ["local", "lsh"]}, report=report)
    local, lsh = model.model.transformer.blocks[0].attn, model.model.transformer.blocks[1].attn
    q, k, v = source.transformer.h[0].attn.c_attn.weight.t().split(32)
    assert torch.equal(local.query.weight, q) and torch.equal(local.key.weight, k)
    assert torch.equal(local.value.weight, v)
    q1 = source.transformer.h[1].attn.c_attn.weight.t().split(32)[0]
    assert torch.equal(lsh.query_key.weight, q1)
    assert report.dropped == ["transformer.h.1.attn.c_attn (k part)"]


def test_local_attention_within_its_window_equals_the_source():
    """Reformer's local layers take q/k/v as they are: within one window they are the source's attention."""
    source = tiny_source(peaked=3.0)
    model = gpt2.convert(source, "reformer", {"attn_layers": ["local"], "local_chunk_length": 32})
    ids = token_ids(length=60)  # two chunks of 32; a causal query sees its chunk and the one before: everything
    with torch.no_grad():
        assert (model(ids).logits - source(ids).logits).abs().max().item() < 1e-10


def test_lara_landmark_transform_starts_at_the_identity():
    model = gpt2.convert(tiny_source(), "lara", {"lara_landmark_transform": True})
    attn = model.model.transformer.blocks[0].attn
    assert torch.equal(attn.landmark_q[0].weight, torch.eye(8, dtype=torch.float64))
    assert not any(p.abs().sum() == 0 for p in (attn.landmark_k[1].weight,))
    assert gpt2.convert(tiny_source(), "lara").model.transformer.blocks[0].attn.landmark_q is None  # default: none


# -- fidelity of the swap -------------------------------------------------------------------------------------
def relative_error(source, model, ids, forward_seeds=(0,)) -> float:
    """Mean squared logit difference over the variance of the source's logits, averaged over forward seeds."""
    with torch.no_grad():
        reference = source(ids).logits
        scale = (reference - reference.mean(-1, keepdim=True)).pow(2).mean()
        total = 0.0
        for seed in forward_seeds:
            torch.manual_seed(seed)
            total += ((model(ids).logits - reference).pow(2).mean() / scale).item()
    return total / len(forward_seeds)


@pytest.mark.parametrize("family, field, values, fixed, ratio", [
    ("performer", "num_random_features", (8, 512), {}, 0.8),
    ("ra", "ra_num_samples", (1, 16), {}, 0.5),
    # causal LARA: a proposal per completed chunk; evaluation is deterministic (omega = mu), so no seeds matter.
    # More proposals help it only slowly (see benchmarks/conversion_fidelity.py).
    ("lara", "lara_chunk_size", (16, 4, 1), {}, 1.0),
    ("reformer", "lsh_num_hashes", (1, 8), {"attn_layers": ["lsh"], "lsh_chunk_length": 8}, 0.8),
])
def test_swap_error_falls_as_the_approximation_gets_finer(family, field, values, fixed, ratio):
    source = tiny_source(peaked=4.0)
    ids = token_ids(batch=2, length=64)
    seeds = range(3) if family != "lara" else range(1)

    def error(value):  # averaged over conversion seeds (random features) and forward seeds (samples, hashes)
        return sum(relative_error(source, gpt2.convert(source, family, {field: value, **fixed}, seed=s).eval(), ids,
                                  forward_seeds=(10 + s,)) for s in seeds) / len(seeds)

    errors = [error(value) for value in values]
    assert all(finer < ratio * coarser for coarser, finer in zip(errors, errors[1:], strict=False)), errors


def test_lsh_error_approaches_full_shared_qk_attention():
    """Many hash rounds approach full shared-QK attention (the limit of LSH, which differs from the source)."""
    source = tiny_source(peaked=4.0)
    ids = token_ids(batch=2, length=64)
    lsh = {"attn_layers": ["lsh"], "lsh_chunk_length": 8}

    def difference(rounds):
        hashed = gpt2.convert(source, "reformer", {**lsh, "lsh_num_hashes": rounds}).eval()
        full = gpt2.convert(source, "reformer", {**lsh, "lsh_full_attention_threshold": 64}).eval()
        with torch.no_grad():
            torch.manual_seed(3)
            return (hashed(ids).logits - full(ids).logits).pow(2).mean().item()

    assert difference(8) < 0.5 * difference(1)


# -- what does not map ----------------------------------------------------------------------------------------
def test_post_layer_norm_bert_is_rejected():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64))
    with pytest.raises(ValueError, match="model_type='bert'.*post-LayerNorm"):
        gpt2.convert(bert, "performer")


@pytest.mark.parametrize("option, message", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"scale_attn_weights": False}, "scale_attn_weights=False"),
    ({"activation_function": "gelu_fast"}, "activation_function='gelu_fast'"),
])
def test_unsupported_gpt2_options_are_named(option, message):
    with pytest.raises(ValueError, match=message):
        gpt2.convert(tiny_source(**option), "softmax")


def test_unknown_source_key_is_named_and_nothing_is_written(tmp_path):
    source = tiny_source()
    source.transformer.h[0].attn.extra_scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.extra_scale"):
        gpt2.convert(source, "lara")
    source.float().save_pretrained(tmp_path / "odd_source")  # on disk: from_pretrained would silently skip it
    with pytest.raises(ValueError, match=r"does not know.*extra_scale"):
        gpt2.main([str(tmp_path / "odd_source"), str(tmp_path / "out"), "--family", "softmax"])
    assert not (tmp_path / "out").exists()


def test_a_failing_cli_conversion_leaves_no_output(saved_source, tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match="fixed by the source checkpoint"):
        gpt2.main([str(saved_source), str(dst), "--family", "performer", "--model", "hidden_size=64"])
    with pytest.raises(ValueError, match="not fields of ZooPerformerConfig"):
        gpt2.main([str(saved_source), str(dst), "--family", "performer", "--model", "num_random_featurez=8"])
    with pytest.raises(ValueError, match="attention 'favor'"):  # a kind of another family
        gpt2.main([str(saved_source), str(dst), "--family", "softmax", "--model", "attn_layers=[favor]"])
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match=r"already holds files: files that are not a run \(keep.txt; no run_args"):
        gpt2.main([str(saved_source), str(dst), "--family", "softmax"])


def test_other_gpt2_heads_are_rejected():
    from transformers import GPT2ForSequenceClassification

    with pytest.raises(ValueError, match="GPT2ForSequenceClassification does not map"):
        gpt2.convert(GPT2ForSequenceClassification(tiny_config()), "softmax")


def test_base_model_reloads_with_auto_model(tmp_path):
    source = tiny_source(GPT2Model).float()
    source.save_pretrained(tmp_path / "src")
    gpt2.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--family", "performer", "--model",
               "num_random_features=16"])
    model = AutoModel.from_pretrained(tmp_path / "dst")
    assert type(model).__name__ == "ZooPerformerModel"
    assert model(token_ids()).last_hidden_state.shape == (2, 40, 32)


# -- uptraining end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_uptraining_a_converted_gpt2_with_train_lm_and_the_recipe(saved_source, tmp_path):
    """The README's three lines: convert, fine-tune with recipes/uptrain_lm.yaml, evaluate."""
    from tests.scripts_helpers import QUIET, ROOT, results, run_script

    converted, out = tmp_path / "performer", tmp_path / "uptrained"
    gpt2.main([str(saved_source), str(converted), "--family", "performer", "--model", "num_random_features=16"])
    short = ["--block_size", "32", "--max_eval_batches", "4", "--per_device_eval_batch_size", "4"]
    before = run_script("evaluate", ["--model_name_or_path", converted, *short])["bits_per_dim"]
    bpd = run_script("train_lm", ["--recipe", ROOT / "recipes" / "uptrain_lm.yaml", "--model_name_or_path", converted,
                                  "--output_dir", out, "--max_train_steps", "8", "--num_warmup_steps", "1",
                                  "--learning_rate", "3e-3", "--per_device_train_batch_size", "4", "--eval_steps", "0",
                                  "--sample_tokens", "8", *short, *QUIET])
    found = results(out)
    assert found["family"] == "performer" and found["train_steps"] == 8 and bpd < before
    after = run_script("evaluate", ["--model_name_or_path", out, *short])["bits_per_dim"]
    assert after == pytest.approx(bpd, rel=1e-6)
