"""`far_kv_heads`: a windowed layer keeps its far part in some key-value heads only. The chosen heads' outputs are the
far layer's, the others' the window's (the same weights), every head listed is the layer without the setting, the
decoding state holds the chosen heads alone, and a wrong value names the field. (Reference, decoding, padding and
remote code for every far part with a head subset: tests/attention/test_far_part_conformance.py.)"""

from __future__ import annotations

import pytest
import torch

from attnzoo.configuration.hybrid import ZooHybridConfig
from attnzoo.modeling.attention.base import build_attention
from attnzoo.modeling.attention.conformance import SMALL as CONFORMANCE_SMALL
from attnzoo.modeling.modeling_hybrid import ZooHybridForCausalLM
from attnzoo.transformers_compat import output_cache

#: the conformance suite's small model (4 query heads of width 8 over 2 key-value heads, a short window, so most keys
#: are far), its far keys at the fixed distance
SMALL = {**CONFORMANCE_SMALL, "far_positions": ["fixed"]}


def heads_out(kind: str, **settings) -> torch.Tensor:
    """[B, L, H, d]: each query head's attention output (the output projection is the identity)."""
    torch.manual_seed(0)
    layer = build_attention(kind, ZooHybridConfig(**{**SMALL, **settings, "attn_layers": [kind]}), 0,
                            True).double().eval()
    with torch.no_grad():
        layer.o_proj.weight.copy_(torch.eye(32))
        x = torch.randn(2, 23, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        return layer(x, position_ids=torch.arange(23).expand(2, -1)).view(2, 23, 4, 8)


def test_the_chosen_heads_read_far_and_the_others_only_their_window():
    """Key-value head 1 keeps the far part: query heads 2 and 3 (which read it) equal block_window's, heads 0 and 1
    equal the window layer's; every head listed is the layer without the setting."""
    far, window = heads_out("block_window"), heads_out("window", far_positions=["rotary"])
    chosen = heads_out("block_window", far_kv_heads=[[1]])
    assert not torch.allclose(far[:, 8:, :2], window[:, 8:, :2])  # the far part changes these heads: can fail
    torch.testing.assert_close(chosen[:, :, 2:], far[:, :, 2:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chosen[:, :, :2], window[:, :, :2], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(heads_out("block_window", far_kv_heads=[[1, 0]]), far, rtol=0, atol=0)


def far_state_bytes(**settings) -> int:
    torch.manual_seed(0)
    model = ZooHybridForCausalLM(ZooHybridConfig(**{**SMALL, "attn_layers": ["block_window"], **settings})).eval()
    ids = torch.randint(1, 37, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for name, t in layer.state.items() if name.startswith("far."))


def test_the_far_state_holds_the_chosen_heads_alone():
    every, one = far_state_bytes(), far_state_bytes(far_kv_heads=[[0]])
    assert every > 0 and one == every // 2


@pytest.mark.parametrize(("value", "says"), [
    ([[]], "lists no head"),
    ([[2]], "distinct key-value heads in 0..1"),
    ([[0, 0]], "distinct"),
    ([["0"]], "list of key-value head indices"),
    ("0", "per layer"),
    ([None, None, [0]], "3 entries for 2 layers"),
])
def test_a_wrong_value_names_the_field(value, says):
    with pytest.raises(ValueError, match="far_kv_heads") as error:
        ZooHybridConfig(**{**SMALL, "attn_layers": ["block_window"], "far_kv_heads": value})
    assert says in str(error.value)


def test_a_layer_without_a_far_part_cannot_list_heads():
    with pytest.raises(ValueError, match=r"far_kv_heads=\[None, \[0\]\] is invalid: layer 1 \('window'\)"):
        ZooHybridForCausalLM(ZooHybridConfig(**{**SMALL, "attn_layers": ["block_window", "window"],
                                                "far_positions": ["fixed", "rotary"], "far_kv_heads": [None, [0]]}))


def test_the_setting_survives_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = ZooHybridForCausalLM(ZooHybridConfig(**{**SMALL, "attn_layers": ["block_window"],
                                                    "far_kv_heads": [[1], None]})).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.far_kv_heads == [[1], None]
    assert [b.attn.far_kv_heads for b in loaded.model.transformer.blocks] == [[1], None]
    ids = torch.randint(1, 37, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
