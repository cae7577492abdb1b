"""Llama / Qwen2 / Mistral -> attnzoo conversion: exact softmax equality (float32 and float64, grouped-query heads,
biases, rope scaling, left padding), the same greedy generation, every family converting, saving, reloading and
decoding with its cache, the report of dropped and fresh weights, unmappable sources failing before anything is
written, and the CLI's output loading where attnzoo is not importable. Sources are tiny models with random weights
built with transformers' own classes (no network)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import attnzoo  # noqa: F401
from attnzoo.convert import llama
from attnzoo.convert.common import FAMILIES, ConversionReport
from attnzoo.tokenization import BYTE_LEVEL_VOCAB_SIZE, byte_level_tokenizer
from tests.scripts_helpers import ROOT

VOCAB = BYTE_LEVEL_VOCAB_SIZE
HIDDEN, HEADS, KV_HEADS = 32, 4, 2  # grouped-query attention: two query heads per key/value head
#: architecture -> (config class, causal-LM class, settings that make its characteristic parts present)
SOURCES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases, no output bias
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}
FAMILY_OPTIONS = {"softmax": {}, "performer": {"num_random_features": 32}, "ra": {},
                  "lara": {"lara_chunk_size": 8}, "reformer": {"lsh_chunk_length": 8, "local_chunk_length": 8},
                  "hybrid": {"num_random_features": 32}}


def tiny_config(arch: str = "llama", **overrides):
    config_class, _, characteristic = SOURCES[arch]
    values = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=256, bos_token_id=257, eos_token_id=258)
    return config_class(**{**values, **characteristic, **overrides})


def randomise(model: nn.Module, seed: int) -> nn.Module:
    """Weights far from their initialisation (which gives near-uniform attention and near-zero biases), so every
    part of the computation matters: N(0, 0.2) weights and biases, norm scales near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def tiny_source(arch: str = "llama", model_class=None, seed: int = 0, dtype=torch.float64, **overrides):
    model_class = model_class or SOURCES[arch][1]
    torch.manual_seed(seed)
    return randomise(model_class(tiny_config(arch, **overrides)), seed).to(dtype).eval()


def token_ids(batch=2, length=40, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def float64_rms_norm(self, hidden_states):
    """RMSNorm computed in the input's dtype (attnzoo's RMSNorm: float32 at least)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def keep_float64_norms(monkeypatch, source) -> None:
    """transformers' Llama/Qwen2/Mistral RMSNorm casts its input to float32 whatever the dtype, so a float64 source
    rounds its norms to float32 (errors ~1e-7) while attnzoo's RMSNorm keeps float64: for the float64 comparisons the
    source's norm computes in float64 too (float32 comparisons use the unpatched source)."""
    monkeypatch.setattr(type(source.model.norm if hasattr(source, "model") else source.norm), "forward",
                        float64_rms_norm)


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def saved_source(tmp_path_factory):
    """A float32 Llama on disk with the byte-level tokenizer and a generation config of its own."""
    folder = tmp_path_factory.mktemp("llama_source")
    source = tiny_source(dtype=torch.float32)
    source.generation_config = GenerationConfig(bos_token_id=257, eos_token_id=258, pad_token_id=256,
                                                max_new_tokens=7)
    source.save_pretrained(folder)
    byte_level_tokenizer(128).save_pretrained(folder)
    return folder


# -- exact softmax conversion ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(SOURCES))
def test_softmax_conversion_gives_the_source_logits_float32(arch):
    source = tiny_source(arch, dtype=torch.float32)
    model = llama.convert(source, "softmax")
    config = model.config
    assert type(model).__name__ == "ZooSoftmaxForCausalLM" and model.dtype == torch.float32
    assert (config.norm_type, config.mlp_type, config.position_embedding_type) == ("rmsnorm", "gated", "rotary")
    assert config.num_key_value_heads == KV_HEADS and config.layer_norm_eps == 1e-6 and config.hidden_act == "silu"
    biases = {"llama": (True, True, True), "qwen2": (True, False, False), "mistral": (False, False, False)}[arch]
    assert (config.attention_bias, config.attention_output_bias, config.mlp_bias) == biases
    ids = token_ids(length=64)
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) < 1e-5


@pytest.mark.parametrize("arch", list(SOURCES))
def test_softmax_conversion_gives_the_source_logits_float64(arch, monkeypatch):
    source = tiny_source(arch)
    keep_float64_norms(monkeypatch, source)
    model = llama.convert(source, "softmax")
    ids = token_ids(length=64)
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) < 1e-10


def test_float64_tolerance_needs_the_norm_patch():
    """Without the patch the float64 source rounds its norms to float32, far outside 1e-10 (so the patch above
    changes what is compared, and the 1e-10 bound can fail)."""
    source = tiny_source()
    model = llama.convert(source, "softmax")
    ids = token_ids(length=64)
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) > 1e-9


@pytest.mark.parametrize("arch", list(SOURCES))
def test_left_padded_batch_equals_the_source_given_the_same_positions(arch, monkeypatch):
    """attnzoo numbers positions from each row's first real token; the source uses the positions it is given."""
    source = tiny_source(arch)
    keep_float64_norms(monkeypatch, source)
    model = llama.convert(source, "softmax")
    ids = token_ids(batch=3, length=24)
    mask = torch.ones_like(ids)
    mask[0, :5], mask[2, :11] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        expected = source(ids, attention_mask=mask, position_ids=positions).logits
        alone = model(ids[2:, 11:]).logits[0]
    assert max_difference(got[real], expected[real]) < 1e-10
    assert max_difference(got[2, 11:], alone) < 1e-10  # and a padded row is its sequence alone


def test_base_llama_model_converts_to_the_base_decoder(monkeypatch):
    source = tiny_source(model_class=LlamaModel)
    keep_float64_norms(monkeypatch, source)
    model = llama.convert(source, "softmax")
    assert type(model).__name__ == "ZooSoftmaxModel" and model.config.is_decoder
    ids = token_ids()
    with torch.no_grad():
        assert max_difference(model(ids).last_hidden_state, source(ids).last_hidden_state) < 1e-10


def test_tied_embeddings_carry_over(monkeypatch):
    source = tiny_source(tie_word_embeddings=True)
    assert source.lm_head.weight.data_ptr() == source.model.embed_tokens.weight.data_ptr()
    keep_float64_norms(monkeypatch, source)
    model = llama.convert(source, "softmax")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = token_ids()
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) < 1e-10


def test_llama_without_biases_and_with_other_settings(monkeypatch):
    source = tiny_source(attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5, hidden_act="gelu_pytorch_tanh",
                         num_key_value_heads=1, rope_theta=500.0, attention_dropout=0.25)
    keep_float64_norms(monkeypatch, source)
    model = llama.convert(source, "softmax")
    config = model.config
    assert not config.attention_bias and not config.mlp_bias and config.num_key_value_heads == 1
    assert (config.hidden_act, config.layer_norm_eps, config.rope_theta) == ("gelu_pytorch_tanh", 1e-5, 500.0)
    assert config.attention_probs_dropout_prob == 0.25 and config.hidden_dropout_prob == 0.0
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (256, 257, 258)
    ids = token_ids()
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) < 1e-10


@pytest.mark.parametrize("arch", list(SOURCES))
def test_softmax_conversion_generates_the_same_tokens(arch):
    source = tiny_source(arch, dtype=torch.float32)
    model = llama.convert(source, "softmax")
    prompt = token_ids(batch=1, length=5)
    expected = source.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    got = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(got, expected)


def test_left_padded_generation_equals_the_source():
    """transformers' generate derives the positions from the mask as attnzoo does, so padded batches decode alike."""
    source = tiny_source(dtype=torch.float32)
    model = llama.convert(source, "softmax")
    prompts = token_ids(batch=2, length=9)
    mask = torch.ones_like(prompts)
    mask[0, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(prompts, **kwargs), source.generate(prompts, **kwargs))


def test_bfloat16_source_keeps_its_float32_rotary_table(tmp_path):
    """Checkpoints are mostly bfloat16; from_pretrained keeps the source's rotary table in float32, and so must the
    converted model (a table rounded to bfloat16 moves every angle)."""
    tiny_source(dtype=torch.bfloat16).save_pretrained(tmp_path)
    source = llama.load_source(str(tmp_path))
    assert source.dtype == torch.bfloat16 and source.model.rotary_emb.inv_freq.dtype == torch.float32
    model = llama.convert(source, "softmax")
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.transformer.blocks[1].attn.rotary.inv_freq, source.model.rotary_emb.inv_freq)
    ids = token_ids(length=64)
    with torch.no_grad():
        assert max_difference(model(ids).logits.float(), source(ids).logits.float()) < 1e-3


def test_generation_config_comes_along():
    source = tiny_source(dtype=torch.float32)
    source.generation_config = GenerationConfig(eos_token_id=[3, 258], max_new_tokens=5, pad_token_id=256)
    model = llama.convert(source, "performer", {"num_random_features": 16})
    assert model.generation_config.eos_token_id == [3, 258] and model.generation_config.max_new_tokens == 5
    assert model.generation_config is not source.generation_config


# -- rotary scaling -------------------------------------------------------------------------------------------
#: theta 100 over 8-wide heads gives wavelengths 6.3, 20, 63 and 200 tokens: with a 32-token original context (and
#: Llama 3.1's factors 1 and 4) one is kept, one blended and two interpolated, every branch of the llama3 rule
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_gives_the_source_logits(kind, monkeypatch):
    source = tiny_source(rope_parameters={**ROPE_SCALINGS[kind], "rope_theta": 100.0})
    keep_float64_norms(monkeypatch, source)
    model = llama.convert(source, "softmax")
    assert model.config.rope_scaling == ROPE_SCALINGS[kind] and model.config.rope_theta == 100.0
    rotary = model.model.transformer.blocks[0].attn.rotary
    inv_freq = rotary.inv_freq  # the same angles as the source's, bit for bit
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, source.model.rotary_emb.inv_freq)
    assert not torch.equal(inv_freq, tiny_source(rope_theta=100.0).model.rotary_emb.inv_freq)  # scaling matters
    ids = token_ids(length=100)
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) < 1e-10


def test_rope_settings_of_older_releases_are_read_too():
    """Before transformers 5 a config had `rope_theta` and `rope_scaling` (with "type" or "rope_type")."""
    from types import SimpleNamespace

    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0}, max_position_embeddings=64)
    assert llama.source_rope(old) == (5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert llama.source_rope(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == (1e4, None)
    assert llama.source_rope(SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2})) == (
        1e4, {"rope_type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        llama.source_rope(SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        llama.source_rope(SimpleNamespace(rope_theta=1e4, rope_scaling=None, partial_rotary_factor=0.5))


def test_rope_parameters_per_layer_type_must_agree():
    from types import SimpleNamespace

    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    same = SimpleNamespace(rope_parameters={"full_attention": linear, "sliding_attention": dict(linear)})
    assert llama.source_rope(same) == (1e4, {"rope_type": "linear", "factor": 2.0})
    differ = SimpleNamespace(rope_parameters={"full_attention": linear, "sliding_attention": {"rope_theta": 1e4}})
    with pytest.raises(ValueError, match="differ between layer types"):
        llama.source_rope(differ)


# -- every family ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_converts_saves_reloads_and_decodes(family, saved_source, tmp_path):
    dst = tmp_path / family
    options = [f"{k}={v}" for k, v in FAMILY_OPTIONS.get(family, {}).items()]
    llama.main([str(saved_source), str(dst), "--family", family, "--model", *options])
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    tokenizer = AutoTokenizer.from_pretrained(dst)
    config = model.config
    assert config.model_type == f"attnzoo_{family}"
    assert not config.reversible and config.position_embedding_type == "rotary" and config.hidden_act == "silu"
    assert config.norm_type == "rmsnorm" and config.mlp_type == "gated" and config.num_key_value_heads == KV_HEADS
    # the hybrid's default (favor, favor, favor, full) fitted to the source's 2 layers, as the model is built
    expected_layers = {"reformer": ["local", "lsh"], "hybrid": ["favor", "full"]}
    assert config.attn_layers == expected_layers.get(family, config.attn_layers)
    assert model.generation_config.max_new_tokens == 7 and model.generation_config.eos_token_id == 258
    source = LlamaForCausalLM.from_pretrained(saved_source)
    # every shared weight carried over
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, source.lm_head.weight)
    assert torch.equal(model.model.transformer.final_norm.weight, source.model.norm.weight)
    for block, source_layer in zip(model.model.transformer.blocks, source.model.layers, strict=True):
        assert torch.equal(block.attn_norm.weight, source_layer.input_layernorm.weight)
        assert torch.equal(block.ffn_norm.weight, source_layer.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            mine, theirs = getattr(block.ffn, name), getattr(source_layer.mlp, name)
            assert torch.equal(mine.weight, theirs.weight) and torch.equal(mine.bias, theirs.bias)
        attn, source_attn = block.attn, source_layer.self_attn
        query = getattr(attn, "q_proj", None) or getattr(attn, "query", None) or attn.query_key
        value = getattr(attn, "v_proj", None) or attn.value
        output = getattr(attn, "o_proj", None) or attn.output
        for mine, theirs in ((query, source_attn.q_proj), (value, source_attn.v_proj),
                             (output, source_attn.o_proj)):
            assert torch.equal(mine.weight, theirs.weight) and torch.equal(mine.bias, theirs.bias)
    # reloads to the function it was converted to, and decodes with its cache as the full forward computes
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    converted = llama.convert(source, family, FAMILY_OPTIONS.get(family, {})).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, converted(ids).logits, rtol=0, atol=1e-6)
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert out.sequences.shape == (1, ids.shape[1] + 8)
    with torch.no_grad():
        full = model(out.sequences[:, :-1], use_cache=False).logits[:, ids.shape[1] - 1:]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, atol=1e-5, rtol=1e-4)
    assert isinstance(tokenizer.decode(out.sequences[0]), str)


def test_hybrid_takes_any_attention_kinds_per_layer(monkeypatch):
    source = tiny_source()
    keep_float64_norms(monkeypatch, source)
    report = ConversionReport()
    model = llama.convert(source, "hybrid", {"attn_layers": ["local", "full"], "local_chunk_length": 64},
                          report=report)
    assert [type(block.attn).__name__ for block in model.model.transformer.blocks] == [
        "LocalAttention", "SoftmaxAttention"]
    assert report.dropped == [] and report.fresh == []
    ids = token_ids(length=60)  # within local attention's window (its chunk and the one before): exact attention
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) < 1e-10


def test_the_hybrid_default_layout_fits_the_source_depth_and_is_printed(saved_source, tmp_path, capsys):
    """A 2-layer Llama converted with --family hybrid used to build two FAVOR+ layers while config.json said
    [favor, favor, favor, full]."""
    llama.main([str(saved_source), str(tmp_path / "hybrid"), "--family", "hybrid", "--model", "num_random_features=8"])
    assert "layers 0 favor, 1 full" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hybrid")
    assert model.config.attn_layers == ["favor", "full"]
    assert json.loads((tmp_path / "hybrid" / "config.json").read_text())["attn_layers"] == ["favor", "full"]
    assert [type(block.attn).__name__ for block in model.model.transformer.blocks] == [
        "FavorAttention", "SoftmaxAttention"]


def test_the_older_config_spelling_still_works_and_names_model(saved_source, tmp_path, capsys):
    """--model NAME=VALUE is the model-settings flag of every script and converter; --config still works."""
    llama.main([str(saved_source), str(tmp_path / "old"), "--family", "performer", "--config", "num_random_features=8"])
    assert "note: --config is the older spelling of --model" in capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "old").config.num_random_features == 8


def test_a_layout_longer_than_the_source_is_refused_before_writing(saved_source, tmp_path):
    with pytest.raises(ValueError, match=r"attn_layers=\['favor', 'full', 'lara'\] is invalid: it lists 3 attention "
                                         r"kinds for 2 layers \(num_hidden_layers=2\)"):
        llama.main([str(saved_source), str(tmp_path / "out"), "--family", "hybrid", "--model",
                    "attn_layers=[favor,full,lara]"])
    assert not (tmp_path / "out").exists()


# -- what the report says -------------------------------------------------------------------------------------
def test_reformer_lsh_layers_share_the_query_projection_and_drop_the_key():
    source = tiny_source(arch="qwen2")
    report = ConversionReport()
    model = llama.convert(source, "reformer", report=report)
    assert model.config.attn_layers == ["local", "lsh"] and model.config.attention_head_size is None
    local, lsh = model.model.transformer.blocks[0].attn, model.model.transformer.blocks[1].attn
    first, second = source.model.layers[0].self_attn, source.model.layers[1].self_attn
    assert torch.equal(local.query.weight, first.q_proj.weight) and torch.equal(local.key.weight, first.k_proj.weight)
    assert torch.equal(local.key.bias, first.k_proj.bias) and local.output.bias is None
    assert torch.equal(lsh.query_key.weight, second.q_proj.weight)
    assert torch.equal(lsh.query_key.bias, second.q_proj.bias)
    assert lsh.value.weight.shape == (KV_HEADS * HIDDEN // HEADS, HIDDEN)  # the source's key/value heads
    assert torch.equal(lsh.value.weight, second.v_proj.weight)
    assert report.dropped == ["model.layers.1.self_attn.k_proj"] and report.fresh == []
    assert "model.layers.1.self_attn.k_proj" in report.summary()


def test_report_names_what_starts_fresh():
    report = ConversionReport()
    llama.convert(tiny_source(), "performer", {"num_random_features": 16}, report=report)
    assert report.fresh == [f"model.transformer.blocks.{i}.attn.eval_projection" for i in range(2)]
    assert report.dropped == []
    report = ConversionReport()
    model = llama.convert(tiny_source(), "lara", {"lara_landmark_transform": True}, report=report)
    assert "model.transformer.blocks.0.attn.landmark_q.0.weight" in report.fresh
    assert torch.equal(model.model.transformer.blocks[0].attn.landmark_q[0].weight,
                       torch.eye(HIDDEN // HEADS, dtype=torch.float64))
    report = ConversionReport()
    llama.convert(tiny_source(), "ra", report=report)
    assert report.summary() == "every weight mapped one to one"


# -- what does not map ----------------------------------------------------------------------------------------
def mixtral_source():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                            num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=2,
                                            num_local_experts=2, num_experts_per_tok=1, sliding_window=None))


def qwen3_source():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                        num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=2,
                                        head_dim=HIDDEN // HEADS))


def gemma_source():
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                        num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=2,
                                        head_dim=HIDDEN // HEADS))


REFUSED = {
    "mistral sliding window": (lambda: tiny_source("mistral", sliding_window=16), r"sliding_window=16"),
    "qwen2 sliding window": (lambda: tiny_source("qwen2", use_sliding_window=True, sliding_window=16,
                                                 max_window_layers=0), r"use_sliding_window=True"),
    "dynamic rope": (lambda: tiny_source(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                     r"rope type 'dynamic'.*use a checkpoint"),
    "yarn rope": (lambda: tiny_source(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
                  r"rope type 'yarn'"),
    "partial rotary": (lambda: tiny_source(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                            "partial_rotary_factor": 0.5}),
                       r"partial_rotary_factor=0\.5"),
    "head_dim": (lambda: tiny_source(head_dim=16), r"head_dim=16 .*hidden_size / num_attention_heads"),
    "pretraining_tp": (lambda: tiny_source(pretraining_tp=2), r"pretraining_tp=2 .*set pretraining_tp to 1"),
    "activation": (lambda: tiny_source(hidden_act="gelu_fast"), r"hidden_act='gelu_fast' \(the zoo has"),
    "qk-norm": (qwen3_source, r"model_type='qwen3'.*qk-norm"),
    "mixture of experts": (mixtral_source, r"model_type='mixtral'.*mixture-of-experts"),
    "other architecture": (gemma_source, r"model_type='gemma'.*reads \['llama', 'mistral', 'qwen2'\]"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_does_not_map_is_named_and_nothing_is_written(case, tmp_path):
    build, message = REFUSED[case]
    source = build()
    with pytest.raises(ValueError, match=message):
        llama.convert(source, "softmax")
    source.float().save_pretrained(tmp_path / "src")
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        llama.main([str(tmp_path / "src"), str(dst), "--family", "performer"])
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))


def test_several_problems_are_named_together():
    with pytest.raises(ValueError, match=r"sliding_window=16.*head_dim=16.*hidden_act='gelu_fast'"):
        llama.check_source_config(tiny_config("mistral", sliding_window=16, head_dim=16, hidden_act="gelu_fast"))


@pytest.mark.parametrize("extra, message", [
    ("self_attn.q_norm", r"model\.layers\.0\.self_attn\.q_norm\.weight.*qk-norm"),
    ("self_attn.extra_scale", r"model\.layers\.0\.self_attn\.extra_scale\.weight"),
])
def test_an_unknown_source_weight_is_named_and_nothing_is_written(extra, message, tmp_path):
    source = tiny_source()
    owner, name = extra.split(".")
    module = getattr(source.model.layers[0], owner)
    setattr(module, name, nn.Module())
    getattr(module, name).weight = nn.Parameter(torch.ones(HIDDEN // HEADS, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"does not know.*" + message):
        llama.convert(source, "reformer")
    source.float().save_pretrained(tmp_path / "odd_source")  # on disk: from_pretrained would silently skip it
    with pytest.raises(ValueError, match=r"does not know.*" + message):
        llama.main([str(tmp_path / "odd_source"), str(tmp_path / "out"), "--family", "softmax"])
    assert not (tmp_path / "out").exists()


def test_an_untied_head_under_a_tied_config_is_refused():
    source = tiny_source(tie_word_embeddings=True)
    source.lm_head.weight = nn.Parameter(source.lm_head.weight.detach().clone() + 1)
    with pytest.raises(ValueError, match="tie_word_embeddings=True but lm_head.weight differs"):
        llama.convert(source, "softmax")


def test_other_llama_heads_are_rejected():
    from transformers import LlamaForSequenceClassification

    with pytest.raises(ValueError, match="LlamaForSequenceClassification does not map"):
        llama.convert(LlamaForSequenceClassification(tiny_config()), "softmax")


def test_a_failing_cli_conversion_leaves_no_output(saved_source, tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match="fixed by the source checkpoint"):
        llama.main([str(saved_source), str(dst), "--family", "performer", "--model", "rope_theta=5.0"])
    with pytest.raises(ValueError, match="fixed by the source checkpoint"):
        llama.main([str(saved_source), str(dst), "--family", "reformer", "--model", "reversible=true"])
    with pytest.raises(ValueError, match="not fields of ZooPerformerConfig"):
        llama.main([str(saved_source), str(dst), "--family", "performer", "--model", "num_random_featurez=8"])
    with pytest.raises(ValueError, match="attention 'favor'"):  # a kind of another family
        llama.main([str(saved_source), str(dst), "--family", "softmax", "--model", "attn_layers=[favor]"])
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match=r"already holds files: files that are not a run \(keep.txt; no run_args"):
        llama.main([str(saved_source), str(dst), "--family", "softmax"])


def test_base_model_reloads_with_auto_model(tmp_path):
    tiny_source(model_class=LlamaModel, dtype=torch.float32).save_pretrained(tmp_path / "src")
    llama.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--family", "ra"])
    model = AutoModel.from_pretrained(tmp_path / "dst")
    assert type(model).__name__ == "ZooRAModel"
    assert model(token_ids()).last_hidden_state.shape == (2, 40, HIDDEN)


# -- the command line, and the output where attnzoo is not importable ----------------------------------------
def test_cli_output_loads_with_remote_code_alone_and_matches_the_source(saved_source, tmp_path):
    dst = tmp_path / "softmax"
    done = subprocess.run([sys.executable, "-m", "attnzoo.convert.llama", str(saved_source), str(dst),
                           "--family", "softmax"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "wrote ZooSoftmaxForCausalLM" in done.stdout and "every weight mapped one to one" in done.stdout
    assert json.loads((dst / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert (dst / "tokenizer.json").is_file() and "auto_map" in json.loads((dst / "config.json").read_text())
    script = f"""
import json, sys
sys.modules["attnzoo"] = None  # as if attnzoo were not installed
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True).eval()
assert "attnzoo" not in type(model).__module__, type(model).__module__
source = transformers.AutoModelForCausalLM.from_pretrained({str(saved_source)!r}).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained({str(dst)!r}, trust_remote_code=True)
ids = tokenizer(["The quick brown fox jumps"], return_tensors="pt").input_ids
with torch.no_grad():
    difference = (model(ids).logits - source(ids).logits).abs().max().item()
greedy = dict(do_sample=False, min_new_tokens=7)  # the generation config's max_new_tokens=7, no early stop
same = torch.equal(model.generate(ids, **greedy), source.generate(ids, **greedy))
print(json.dumps({{"difference": difference, "same": same, "max_new_tokens": model.generation_config.max_new_tokens,
                  "class": type(model).__name__}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["difference"] < 1e-5 and result["same"]
    assert result["max_new_tokens"] == 7 and result["class"] == "ZooSoftmaxForCausalLM"


def test_lsh_window_with_separate_queries_and_keys_keeps_the_key_projection_and_the_source_logits(monkeypatch):
    """With lsh_shared_qk=false the LSH layers keep the source's q, k, v and o projections (nothing dropped), and a
    window wider than the sequence makes every key near: the source's logits, as for the other windowed layers."""
    source = tiny_source()
    keep_float64_norms(monkeypatch, source)
    report = ConversionReport()
    model = llama.convert(source, "reformer", {"attn_layers": ["lsh_window"], "lsh_shared_qk": False,
                                               "window_size": 64, "num_sink_tokens": 0}, report=report)
    assert report.dropped == [] and report.fresh == []
    attn, original = model.model.transformer.blocks[0].attn, source.model.layers[0].self_attn
    assert torch.equal(attn.k_proj.weight, original.k_proj.weight)
    ids = token_ids(length=60)
    with torch.no_grad():
        assert max_difference(model(ids).logits, source(ids).logits) < 1e-10
    # a window narrower than the sequence: the far part (LSH over the source's own queries and keys) takes over
    narrow = llama.convert(source, "reformer", {"attn_layers": ["lsh_window"], "lsh_shared_qk": False,
                                                "window_size": 16, "num_sink_tokens": 4})
    with torch.no_grad():
        assert 0 < max_difference(narrow(ids).logits, source(ids).logits) < 10


@pytest.mark.parametrize("kind", ["window", "lsh_window"])
def test_adjacent_sinks_convert_from_llama_and_decode_as_the_full_forward(kind, monkeypatch):
    """`sink_positions="adjacent"` in a converted Llama: with the window wider than the sequence no sink is ever seen
    as a sink, so the logits are the source's; with a narrow one the sinks move and cached greedy decoding still
    follows the full forward."""
    source = tiny_source()
    keep_float64_norms(monkeypatch, source)
    settings = {"attn_layers": [kind], "lsh_shared_qk": False, "sink_positions": "adjacent", "lsh_chunk_length": 8}
    wide = llama.convert(source, "hybrid", {**settings, "window_size": 64, "num_sink_tokens": 4})
    ids = token_ids(length=40)
    with torch.no_grad():
        assert max_difference(wide(ids).logits, source(ids).logits) < 1e-10
    narrow = llama.convert(source, "hybrid", {**settings, "window_size": 8, "num_sink_tokens": 4})
    absolute = llama.convert(source, "hybrid", {**settings, "window_size": 8, "num_sink_tokens": 4,
                                                "sink_positions": "absolute"})
    prompt = ids[:1, :30]
    with torch.no_grad():
        assert max_difference(narrow(prompt).logits, absolute(prompt).logits) > 1e-6
        out = narrow.generate(prompt, max_new_tokens=6, do_sample=False)
        full = narrow(out).logits[:, prompt.shape[1] - 1:-1].argmax(-1)
    assert torch.equal(out[:, prompt.shape[1]:], full)
