"""Configuration validation and derived values; position embeddings; the byte tokenizer; recipes."""

import argparse
import json

import pytest
import torch

from attnzoo import ZooConfig, ZooSoftmaxConfig, ZooSoftmaxForCausalLM
from attnzoo.modeling.embeddings import AxialPositionEmbedding
from attnzoo.tokenization import byte_level_tokenizer
from attnzoo.training.recipes import parse_model_overrides, parse_with_recipe


def test_attn_layers_repeat_to_depth():
    config = ZooSoftmaxConfig(num_hidden_layers=5, attn_layers=["full"])
    assert config.layer_attention_kinds() == ["full"] * 5
    assert config.num_decoder_layers == 5


def test_error_names_field_and_fix():
    with pytest.raises(ValueError, match=r"num_attention_heads=3 .*divide hidden_size=256"):
        ZooSoftmaxConfig(num_attention_heads=3)
    with pytest.raises(ValueError, match=r"attn_layers.*unknown attention 'lsh-typo'"):
        ZooSoftmaxForCausalLM(ZooSoftmaxConfig(attn_layers=["lsh-typo"]))
    with pytest.raises(ValueError, match=r"attn_layers.*'lsh'.*ZooReformerConfig"):  # a kind of another family
        ZooSoftmaxForCausalLM(ZooSoftmaxConfig(attn_layers=["lsh"]))
    with pytest.raises(ValueError, match="axial_pos_shape"):
        ZooSoftmaxConfig(position_embedding_type="axial", max_position_embeddings=100, axial_pos_shape=[8, 8],
                         axial_pos_embds_dim=[128, 128])


def test_axial_shape_and_dims_are_derived_and_round_trip(tmp_path):
    config = ZooSoftmaxConfig(position_embedding_type="axial", max_position_embeddings=1000, hidden_size=64,
                              num_attention_heads=4)
    assert config.axial_pos_shape[0] * config.axial_pos_shape[1] >= 1000
    assert sum(config.axial_pos_embds_dim) == 64
    config.save_pretrained(tmp_path)
    again = ZooSoftmaxConfig.from_pretrained(tmp_path)
    assert again.axial_pos_shape == config.axial_pos_shape and again.attn_layers == ["full"]
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "attnzoo_softmax"


def test_family_config_is_a_zoo_config():
    assert issubclass(ZooSoftmaxConfig, ZooConfig)


def test_axial_embedding_matches_reformer_broadcast_layout():
    torch.manual_seed(0)
    emb = AxialPositionEmbedding([4, 6], [3, 5])
    for w in emb.weights:
        torch.nn.init.normal_(w)
    # Reformer builds the table by broadcasting [4, 1, 3] and [1, 6, 5] to [4, 6, 8] and flattening row-major.
    table = torch.cat([emb.weights[0][:, None].expand(4, 6, 3), emb.weights[1][None].expand(4, 6, 5)], dim=-1)
    positions = torch.arange(24)
    torch.testing.assert_close(emb(positions), table.reshape(24, 8))
    torch.testing.assert_close(emb(positions[5:17]), table.reshape(24, 8)[5:17])  # any length, any offset


def test_byte_tokenizer_ids_are_bytes_and_round_trip(tmp_path):
    from transformers import AutoTokenizer

    text = "naïve café ☃\n\tend"
    tokenizer = byte_level_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).decode(ids) == text


def test_recipe_values_are_defaults_and_cli_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 0.5\nsteps: 7\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning_rate", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=1)
    args = parse_with_recipe(parser, ["--recipe", str(recipe), "--steps", "9"])
    assert args.learning_rate == 0.5 and args.steps == 9
    recipe.write_text("learning_rat: 0.5\n")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_with_recipe(argparse.ArgumentParser(), ["--recipe", str(recipe)])


def test_model_overrides_parse_yaml_values():
    assert parse_model_overrides(["hidden_size=128", "attn_layers=[local, lsh]", "reversible=true"]) == {
        "hidden_size": 128, "attn_layers": ["local", "lsh"], "reversible": True}
    with pytest.raises(ValueError, match="name=value"):
        parse_model_overrides(["hidden_size"])


@pytest.mark.parametrize("model_type, key, value, field", [
    ("attnzoo_reformer", "num_hashes", 4, "lsh_num_hashes"),  # transformers' Reformer spelling
    ("attnzoo_reformer", "num_buckets", 16, "lsh_num_buckets"),
    ("attnzoo_reformer", "feed_forward_size", 96, "intermediate_size"),
    ("attnzoo_performer", "nb_features", 64, "num_random_features"),  # performer-pytorch's
])
def test_other_projects_names_for_a_setting_set_it(model_type, key, value, field):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{key: value})
    assert getattr(config, field) == value and not hasattr(config, key)
    assert type(config).from_dict(config.to_dict()).to_dict() == config.to_dict()  # saved and reloaded as itself


@pytest.mark.parametrize("model_type, values, message", [
    ("attnzoo_softmax", dict(attn_layer=["lsh"]), r"attn_layer=\['lsh'\] is not a setting of ZooSoftmaxConfig; did "
                                                  r"you mean 'attn_layers'\?"),
    ("attnzoo_reformer", dict(num_hash=4), r"num_hash=4 is not a setting of ZooReformerConfig; did you mean "
                                           r"'lsh_num_hashes'\?"),
    ("attnzoo_softmax", dict(nb_features=64), r"nb_features is another name for num_random_features, "
                                              r"which ZooSoftmaxConfig does not have"),
    ("attnzoo_reformer", dict(num_hashes=4, lsh_num_hashes=3), r"num_hashes=4 and lsh_num_hashes=3 set the same "
                                                               r"thing.*pass only lsh_num_hashes"),
])
def test_unknown_settings_are_refused_naming_the_close_match(model_type, values, message):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=message):
        AutoConfig.for_model(model_type, **values)


def test_saved_configs_load_with_the_keys_transformers_writes(tmp_path):
    from transformers import AutoConfig

    config = ZooSoftmaxConfig(hidden_size=32, num_attention_heads=2, id2label={0: "neg", 1: "pos"},
                              architectures=["ZooSoftmaxForSequenceClassification"], tokenizer_class="T")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path).to_dict()
    assert {k: v for k, v in loaded.items() if k != "_name_or_path"} == \
        {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def test_window_settings_live_only_with_windowed_attentions_and_old_softmax_configs_still_load(tmp_path):
    """`window_size` and `num_sink_tokens` belong to the configs whose families have a windowed attention; a
    softmax config saved when every family had them (they were never read) loads and rebuilds the same model, while
    one whose layers did use a window is refused with the config to load it with, nothing changed on disk."""
    from attnzoo import ZooHybridConfig, ZooWindowConfig
    from attnzoo.configuration import ZooWindowSettings

    assert "window_size" not in ZooSoftmaxConfig.__dataclass_fields__
    assert issubclass(ZooHybridConfig, ZooWindowSettings) and issubclass(ZooWindowConfig, ZooWindowSettings)
    with pytest.raises(ValueError, match=r"window_size=16 is not a setting of ZooSoftmaxConfig; it is one of "
                                         r"ZooHybridConfig, ZooLARAConfig, .*ZooWindowConfig: build the model"):
        ZooSoftmaxConfig(window_size=16)
    torch.manual_seed(0)
    model = ZooSoftmaxForCausalLM(ZooSoftmaxConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32, is_decoder=True))
    model.save_pretrained(tmp_path / "old")
    saved = json.loads((tmp_path / "old" / "config.json").read_text())
    saved.update(window_size=64, num_sink_tokens=4)  # what every family's config.json carried before
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    loaded = ZooSoftmaxForCausalLM.from_pretrained(tmp_path / "old").eval()
    assert not hasattr(loaded.config, "window_size")
    ids = torch.arange(1, 9)[None]
    torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits)
    saved.update(attn_layers=["window"])
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    before = (tmp_path / "old" / "config.json").read_bytes()
    with pytest.raises(ValueError, match=r"use \['window'\].*ZooWindowConfig.from_pretrained\(path\)"):
        ZooSoftmaxConfig.from_pretrained(tmp_path / "old")
    assert (tmp_path / "old" / "config.json").read_bytes() == before
    config = ZooWindowConfig.from_pretrained(tmp_path / "old")
    assert config.window_size == 64 and config.attn_layers == ["window"]
