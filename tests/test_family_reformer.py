"""The shared family suite for the Reformer family (LSH and local attention, reversible, axial positions)."""

from attnzoo import ZooReformerConfig
from tests.family_suite import FamilySuite


class TestReformerFamily(FamilySuite):
    config_class = ZooReformerConfig
    prefix = "ZooReformer"
    # Local chunks of 4 make every suite sequence span several chunks. LSH hashes with fresh random rotations on
    # every call, so tests that compare two separate forwards (cached vs uncached generation, a padded batch vs each
    # row alone) need sequences the full-attention fallback covers (<= 32 tokens; the suite's longest is 18); the
    # 33-token training run still hashes. Hashing itself, with fixed rotations, is tested in
    # test_attention_lsh_local.py (fast path vs reference, padding, cached decoding, reversible buckets).
    config_overrides = dict(lsh_chunk_length=8, lsh_full_attention_threshold=32, local_chunk_length=4)
    attention_patterns = [("local", "lsh"), ("lsh",), ("local",)]
