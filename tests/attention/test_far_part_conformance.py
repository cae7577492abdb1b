"""The far-part contract over the whole registry (`attnzoo.modeling.attention.conformance`): every registered far
part's windowed layer, and the window with none, in each of its distinct settings, passes every check. A far part
added to the package is checked here with no test of its own."""

import pytest

from attnzoo.modeling.attention import ATTENTION_REGISTRY, FAR_PART_REGISTRY
from attnzoo.modeling.attention.conformance import CHECKS, remote_code_round_trips

#: settings that change which code a far part runs (each a case of its own beside the defaults)
VARIANTS = {
    "favor": [{"feature_redraw": "learned"}],
    "lara": [{"lara_weighting": "query_specific"}],
    "ra": [{"ra_variant": "biased"}],
    "lsh": [{"lsh_attend_to": "chunk"}, {"lsh_shared_qk": False},
            {"lsh_shared_qk": False, "lsh_group_rotations": True},
            {"lsh_shared_qk": False, "lsh_centre_keys": True, "lsh_key_centroids": True},
            {"lsh_shared_qk": False, "lsh_centre_keys": True, "lsh_key_centroids": True, "lsh_member_mean_block": 3},
            {"lsh_shared_qk": False, "lsh_centre_keys": True, "lsh_key_centroids": True, "lsh_member_mean_block": 2,
             "lsh_member_score": "log_mass"}],
    "dense": [{"far_positions": ["fixed"]}, {"far_positions": ["grouped"], "far_position_group": 2}],
    "block": [{"block_query_size": 1}, {"block_key_bits": 8, "block_value_bits": 4},
              {"block_key_bits": 4, "block_value_bits": 8, "block_query_size": 1}],
}
CASES = [("window", {}), ("window", {"sink_positions": "adjacent"})] + [
    (f"{name}_window", settings) for name in sorted(FAR_PART_REGISTRY)
    for settings in [{}, *VARIANTS.get(name, [])]]
CASES += [(f"{name}_window", {"far_positions": ["none"]}) for name in sorted(FAR_PART_REGISTRY)
          if ATTENTION_REGISTRY[f"{name}_window"].position_free_far_part]
#: the far part kept in one of the two key-value heads (`far_kv_heads`): built for that head alone, the layer widens
#: its triple to every query head
CASES += [(f"{name}_window", {"far_kv_heads": [[1]]}) for name in sorted(FAR_PART_REGISTRY)]
CASES += [("lsh_window", {"far_kv_heads": [[1]], "lsh_shared_qk": False})]
CASES += [("block_window", {"far_kv_heads": [[1]], "block_key_bits": 8, "block_value_bits": 4})]
#: checks a setting does not promise: LSH's "chunk" candidates are the chunks around a query in the sorted order of
#: the whole sequence, which a decoding step does not have (only "bucket" decodes as the full forward does;
#: docs/lsh_attention.md, section 6)
NOT_PROMISED = {("lsh_window", "lsh_attend_to", "chunk"): {"decoding_equals_full_forward"}}


def promised(case, check) -> bool:
    kind, settings = case
    return not any(check in NOT_PROMISED.get((kind, key, str(value)), ()) for key, value in settings.items())


def case_id(case):
    kind, settings = case
    return kind + "".join(f"-{key}={value}" for key, value in settings.items())


@pytest.mark.parametrize(("case", "check"), [(case, check) for case in CASES for check in CHECKS
                                             if check != "remote_code_round_trip" and promised(case, check)],
                         ids=lambda x: x if isinstance(x, str) else case_id(x))
def test_every_far_part_meets_the_contract(case, check):
    kind, settings = case
    CHECKS[check](kind, **settings)


def test_every_far_part_loads_from_the_code_its_checkpoint_carries(tmp_path):
    """One process without attnzoo loads every kind's checkpoint (a process per kind would cost 10 s each)."""
    remote_code_round_trips([("window", {}), *((f"{name}_window", {}) for name in sorted(FAR_PART_REGISTRY)),
                             ("block_window", {"far_kv_heads": [[1]]}),
                             ("block_window", {"block_key_bits": 8, "block_value_bits": 4})], tmp_path)


def test_the_registry_is_what_the_suite_covers():
    """A far part registered in the package is a case here (the suite reads the registry, not a list)."""
    assert {"favor", "lara", "ra", "lsh"} <= set(FAR_PART_REGISTRY)
    assert {kind for kind, _ in CASES} >= {f"{name}_window" for name in FAR_PART_REGISTRY}
