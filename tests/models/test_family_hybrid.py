"""The shared family suite for hybrid stacks, built as Llama layers: every attention kind of every family in one
model, with rotary positions, grouped-query heads (4 query heads share 2 key/value heads), RMSNorm, a gated SiLU
feed-forward and Qwen2-style biases (q/k/v, none on the output)."""

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
