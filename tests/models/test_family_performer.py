import json

from attnzoo import ZooPerformerConfig, ZooPerformerModel
from tests.family_suite import FamilySuite


class TestPerformerFamily(FamilySuite):
    config_class = ZooPerformerConfig
    prefix = "ZooPerformer"
    config_overrides = {"num_random_features": 16, "linear_attention_chunk_size": 4}
    attention_patterns = [("favor",), ("elu",), ("favor", "full")]


def test_default_random_features_follow_the_head_size(tmp_path):
    """m defaults to round(d · ln d) for head size d (64 -> 266, 16 -> 44): small heads no longer pay for 256
    features; an explicit m is kept, and the saved config carries the number, so a checkpoint never changes."""
    from attnzoo.configuration.base import default_num_random_features

    assert [default_num_random_features(d) for d in (1, 2, 16, 32, 64, 128)] == [1, 1, 44, 111, 266, 621]
    small = ZooPerformerConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32)
    assert small.num_random_features == 44 and ZooPerformerConfig(num_random_features=32).num_random_features == 32
    model = ZooPerformerModel(small)
    assert model.transformer.blocks[0].attn.num_features == 44
    small.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_random_features"] == 44
