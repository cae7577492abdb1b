from attnzoo import ZooRAConfig
from tests.family_suite import FamilySuite


class TestRAFamily(FamilySuite):
    config_class = ZooRAConfig
    prefix = "ZooRA"
    # Unbiased RA samples its index at evaluation too, from seeded draws (deterministic, `eval_seed`), so the
    # suite's exact comparisons hold for both variants; most tests run the biased one, the determinism test the
    # default unbiased one.
    config_overrides = {"ra_variant": "biased"}
    evaluation_randomness = {"ra_variant": "unbiased"}
    attention_patterns = [("ra",), ("ra", "full")]
