"""The shared family suite for the window family (sliding window with attention sinks), with windows short enough
that the suite's 12-16 token sequences span several windows and the sinks matter."""

from attnzoo import ZooWindowConfig
from tests.family_suite import FamilySuite
from tests.models.test_family_hybrid import LLAMA_LAYER


class TestWindowFamily(FamilySuite):
    config_class = ZooWindowConfig
    prefix = "ZooWindow"
    config_overrides = {"window_size": 4, "num_sink_tokens": 2}
    attention_patterns = [("window",), ("window", "full")]


class TestWindowFamilyOnLlamaLayers(TestWindowFamily):
    config_overrides = dict(LLAMA_LAYER, window_size=3, num_sink_tokens=1)
    attention_patterns = [("window",)]
