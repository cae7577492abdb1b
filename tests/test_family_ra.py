from attnzoo import ZooRAConfig
from tests.family_suite import FamilySuite


class TestRAFamily(FamilySuite):
    config_class = ZooRAConfig
    prefix = "ZooRA"
    # The suite compares deterministic evaluation outputs; unbiased RA samples its index even at evaluation
    # (spec §3.1), so the suite runs the biased variant and test_attention_ra.py covers the unbiased one.
    config_overrides = {"ra_variant": "biased"}
    attention_patterns = [("ra",), ("ra", "full")]
