"""attnzoo -> attnzoo conversion (`attnzoo.convert.attention`): a new attention on the same backbone. Equal logits
where the new attention equals the old on the input (full attention in the hybrid family, a separate-QK lsh_window
wider than the sequence), float64; the backbone copied bitwise; what is dropped, kept and fresh reported; the
family's own settings and learned attention parameters kept within a family; far-position settings usable for
decoding; and sources that cannot convert refused with the fix, before anything is written."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config

import attnzoo  # noqa: F401
from attnzoo.convert import attention
from attnzoo.convert.common import ConversionReport
from attnzoo.tokenization import byte_level_tokenizer
from attnzoo.training.loop import new_model_config

BACKBONE = ["vocab_size=259", "hidden_size=32", "num_hidden_layers=2", "num_attention_heads=4",
            "intermediate_size=64", "position_embedding_type=rotary", "hidden_dropout_prob=0.0", "is_decoder=true",
            "max_position_embeddings=256"]


def source_model(family="softmax", settings=(), head=AutoModelForCausalLM, seed=0):
    """An attnzoo model with weights far from their initialisation (N(0, 0.2); norm scales near 1), float64."""
    torch.manual_seed(seed)
    model = head.from_config(new_model_config(family, {}, [*BACKBONE, *settings]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.double().eval()


def ids(length=48, batch=2, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_difference(a, b, tokens) -> float:
    with torch.no_grad():
        return (a(tokens).logits - b(tokens).logits).abs().max().item()


def test_full_attention_in_another_family_gives_the_source_logits_and_copies_the_backbone():
    source = source_model()
    report = ConversionReport()
    model = attention.convert(source, "hybrid", {"attn_layers": ["full"]}, report=report)
    assert type(model).__name__ == "ZooHybridForCausalLM" and model.dtype == torch.float64
    assert report.dropped == [] and report.fresh == []
    assert logits_difference(model, source, ids()) < 1e-12
    target = model.state_dict()
    assert all(torch.equal(target[key], value) for key, value in source.state_dict().items())


def test_separate_qk_lsh_window_wider_than_the_sequence_gives_the_source_logits():
    source = source_model()
    wide = attention.convert(source, "reformer", {"attn_layers": ["lsh_window"], "lsh_shared_qk": False,
                                                  "window_size": 64, "num_sink_tokens": 0})
    assert wide.config.attention_head_size is None and wide.config.reversible is False
    assert logits_difference(wide, source, ids()) < 1e-10
    narrow = attention.convert(source, "reformer", {"attn_layers": ["lsh_window"], "lsh_shared_qk": False,
                                                    "window_size": 8, "num_sink_tokens": 4, "lsh_chunk_length": 8})
    assert 1e-6 < logits_difference(narrow, source, ids()) < 10  # the far part (LSH) takes over beyond the window


def test_shared_qk_target_drops_the_key_projection_and_a_shared_qk_source_cannot_lose_it():
    source = source_model()
    report = ConversionReport()
    shared = attention.convert(source, "reformer", {"attn_layers": ["lsh"], "lsh_chunk_length": 8}, report=report)
    assert report.dropped == ["model.transformer.blocks.0.attn.k_proj", "model.transformer.blocks.1.attn.k_proj"]
    assert torch.equal(shared.model.transformer.blocks[0].attn.query_key.weight,
                       source.model.transformer.blocks[0].attn.q_proj.weight)
    with pytest.raises(ValueError, match="lsh_shared_qk=true"):
        attention.convert(shared, "softmax")


def test_irope_layout_with_far_positions_converts_and_decodes_as_its_full_forward():
    """What docs/long_context.md converts: three rotary window layers and a position-free, log-scaled global one."""
    source = source_model()
    model = attention.convert(source, "hybrid", {
        "attn_layers": ["window", "lsh_window"], "window_size": 8, "num_sink_tokens": 2, "lsh_chunk_length": 8,
        "lsh_shared_qk": False, "far_positions": ["rotary", "none"], "far_query_scale": "log",
        "far_query_scale_length": 16})
    assert model.config.layer_attention_kinds() == ["window", "lsh_window"]
    prompt = ids(length=40, batch=1)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False)
        full = model(out).logits[:, prompt.shape[1] - 1:-1].argmax(-1)
    assert torch.equal(out[:, prompt.shape[1]:], full)


def test_within_a_family_the_settings_and_learned_attention_parameters_are_kept():
    source = source_model("performer", ["feature_redraw=learned", "num_random_features=16"])
    report = ConversionReport()
    model = attention.convert(source, "performer", {"attn_layers": ["favor_window"], "window_size": 8}, report=report)
    assert model.config.feature_redraw == "learned" and model.config.num_random_features == 16
    learned = [k for k in source.state_dict() if k.endswith(".attn.learned_projection")]
    assert learned and report.dropped == []
    assert all(torch.equal(model.state_dict()[k], source.state_dict()[k]) for k in learned)
    # into another family the performer's own settings stay behind and its learned features are reported dropped
    other = ConversionReport()
    attention.convert(source, "softmax", report=other)
    assert sorted(other.dropped) == sorted(learned)


def test_the_base_model_converts_to_the_base_model():
    source = source_model(head=AutoModel)
    model = attention.convert(source, "hybrid", {"attn_layers": ["full"]})
    assert type(model).__name__ == "ZooHybridModel"
    with torch.no_grad():
        assert (model(ids()).last_hidden_state - source(ids()).last_hidden_state).abs().max() < 1e-12


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_size": 64}, "fixed by the source"),
    ({"rope_theta": 500000.0}, "fixed by the source"),
    ({"lsh_num_hashs": 2}, "check the spelling"),
])
def test_settings_that_change_the_backbone_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        attention.convert(source_model(), "reformer", overrides)


def test_adjustable_settings_take_the_users_value():
    model = attention.convert(source_model(), "hybrid", {"max_position_embeddings": 4096, "hidden_dropout_prob": 0.1})
    assert model.config.max_position_embeddings == 4096 and model.config.hidden_dropout_prob == 0.1


def test_a_transformers_config_is_not_an_attnzoo_source():
    with pytest.raises(ValueError, match="attnzoo.convert.gpt2"):
        attention.check_source_config(GPT2Config())


def test_cli_writes_a_loadable_model_and_refuses_a_folder_with_files(tmp_path):
    source = source_model().float()
    source.save_pretrained(tmp_path / "src")
    byte_level_tokenizer(256).save_pretrained(tmp_path / "src")
    attention.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--family", "hybrid",
                    "--model", "attn_layers=[full]"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert logits_difference(loaded, source.eval(), ids()) < 1e-5
    assert (tmp_path / "dst" / "tokenizer_config.json").is_file()
    before = sorted(p.name for p in (tmp_path / "dst").iterdir())
    with pytest.raises(ValueError, match="already holds files"):
        attention.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--family", "softmax"])
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == before
