from attnzoo import ZooLARAConfig
from tests.family_suite import FamilySuite


class TestLARAFamily(FamilySuite):
    config_class = ZooLARAConfig
    prefix = "ZooLARA"
    # Few proposals and short chunks, so 12-16 token test sequences exercise segments and several causal chunks.
    config_overrides = {"lara_num_samples": 4, "lara_chunk_size": 3}
    attention_patterns = [("lara",), ("lara", "full")]
