"""The shared family suite for hybrid stacks, built as Llama layers: every attention kind of every family in one
model, with rotary positions, grouped-query heads (4 query heads share 2 key/value heads), RMSNorm, a gated SiLU
feed-forward and Qwen2-style biases (q/k/v, none on the output)."""

import json

import pytest
from transformers import AutoConfig

from attnzoo import ZooHybridConfig
from tests.family_suite import FamilySuite

LLAMA_LAYER = dict(position_embedding_type="rotary", num_key_value_heads=2, norm_type="rmsnorm", mlp_type="gated",
                   hidden_act="silu", mlp_bias=False, attention_bias=True, attention_output_bias=False)


class TestHybridFamily(FamilySuite):
    config_class = ZooHybridConfig
    prefix = "ZooHybrid"
    config_overrides = dict(LLAMA_LAYER, num_random_features=16, linear_attention_chunk_size=4, lsh_chunk_length=8,
                            local_chunk_length=4, lara_num_samples=4, lara_chunk_size=3)
    attention_patterns = [("favor", "full"), ("local", "lsh"), ("ra", "lara"), ("elu", "lsh")]


def test_a_layout_longer_than_the_stack_is_refused_with_both_numbers():
    """["favor", "full", "lara"] with 2 layers used to build FAVOR+ and softmax and drop "lara" without a word."""
    with pytest.raises(ValueError, match=r"attn_layers=\['favor', 'full', 'lara'\] is invalid: it lists 3 attention "
                                         r"kinds for 2 layers \(num_hidden_layers=2\).*set num_hidden_layers to 3"):
        ZooHybridConfig(num_hidden_layers=2, attn_layers=["favor", "full", "lara"])
    with pytest.raises(ValueError, match=r"decoder_attn_layers=.* it lists 2 attention kinds for 1 layers "
                                         r"\(num_decoder_layers=1\)"):
        ZooHybridConfig(num_hidden_layers=2, num_decoder_layers=1, decoder_attn_layers=["favor", "full"])
    assert ZooHybridConfig(num_hidden_layers=3, attn_layers=["favor", "full"]).layer_attention_kinds() == [
        "favor", "full", "favor"]  # a shorter list repeats


@pytest.mark.parametrize("depth, layout", [(1, ["full"]), (2, ["favor", "full"]), (3, ["favor", "favor", "full"]),
                                           (4, ["favor", "favor", "favor", "full"])])
def test_the_default_layout_fits_a_shallow_stack_and_keeps_a_softmax_layer(depth, layout):
    config = ZooHybridConfig(num_hidden_layers=depth)
    assert config.attn_layers == layout and config.layer_attention_kinds() == layout


def test_a_saved_config_with_a_longer_layout_loads_as_its_model_was_built(tmp_path, caplog):
    """Configs saved before the check listed the 4-kind default for 2 layers; the model used the first two."""
    ZooHybridConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "attn_layers": ["favor", "favor", "favor", "full"]}))
    with caplog.at_level("WARNING"):
        loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.attn_layers == ["favor", "favor"]
    assert "lists 4 kinds in attn_layers for 2 layers; the model uses the first 2" in caplog.text
