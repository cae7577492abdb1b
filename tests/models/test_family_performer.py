from attnzoo import ZooPerformerConfig
from tests.family_suite import FamilySuite


class TestPerformerFamily(FamilySuite):
    config_class = ZooPerformerConfig
    prefix = "ZooPerformer"
    config_overrides = {"num_random_features": 16, "linear_attention_chunk_size": 4}
    attention_patterns = [("favor",), ("elu",), ("favor", "full")]
