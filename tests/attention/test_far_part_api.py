"""The far-part API of the windowed layer, as a user of docs/adding_an_attention.md meets it: `register_far_part`
registers both names or neither (a clash of the generated `<name>_window` kind leaves nothing behind, so a
corrected retry succeeds), and a far part whose outputs have the wrong shapes is refused with a ValueError naming
it and the expected shapes, in each of its forms (parallel, step, reference), instead of a bare torch error or a
silent broadcast inside the one normalisation."""

from __future__ import annotations

import re

import pytest
import torch

from attnzoo import ZooWindowConfig
from attnzoo.modeling.attention import (
    ATTENTION_REGISTRY,
    FAR_PART_REGISTRY,
    ZooAttention,
    build_attention,
    register_attention,
    register_far_part,
)
from attnzoo.modeling.attention.window_linear import FeatureFarPart
from attnzoo.modeling.cache import ZooCache


@pytest.fixture(autouse=True)
def registries():
    """Every test's registrations are undone: the registries are shared by the whole test session."""
    attentions, far_parts = dict(ATTENTION_REGISTRY), dict(FAR_PART_REGISTRY)
    yield
    for registry, saved in ((ATTENTION_REGISTRY, attentions), (FAR_PART_REGISTRY, far_parts)):
        registry.clear()
        registry.update(saved)


def elu_far_part(name: str, breaks: dict | None = None) -> type[FeatureFarPart]:
    """A far part of elu + 1 features (as docs/adding_an_attention.md's), registered as `name`, whose form named in
    `breaks` passes its (numerator, denominator, log scale) through the function given there."""
    breaks = breaks or {}

    class EluFarPart(FeatureFarPart):
        def query_log_features(self, q, constants=None):
            return torch.where(q > 0, torch.log1p(q.clamp(min=0)), q)

        key_log_features = query_log_features

        def parallel(self, *args, **kwargs):
            return breaks.get("parallel", lambda out: out)(super().parallel(*args, **kwargs))

        def step(self, *args, **kwargs):
            return breaks.get("step", lambda out: out)(super().step(*args, **kwargs))

        def reference(self, *args, **kwargs):
            return breaks.get("reference", lambda out: out)(super().reference(*args, **kwargs))

    return register_far_part(name)(EluFarPart)


# -- both names or neither ----------------------------------------------------------------------------------------
def test_a_clashing_window_kind_registers_nothing_and_a_corrected_retry_succeeds():
    @register_attention("myfar_window")
    class MyFarWindow(ZooAttention):  # the user's own attention, which happens to have the generated name
        pass

    message = ("far part name 'myfar' would register the attention kind 'myfar_window', which is already registered "
               f"to MyFarWindow (module {__name__}); give EluFarPart another name in @register_far_part (nothing "
               "was registered).")
    with pytest.raises(ValueError, match=re.escape(message)):
        elu_far_part("myfar")
    assert "myfar" not in FAR_PART_REGISTRY and ATTENTION_REGISTRY["myfar_window"] is MyFarWindow
    # the retry under the far part's name, once the clashing attention is renamed (a notebook re-running its cells)
    del ATTENTION_REGISTRY["myfar_window"]
    register_attention("my_other_window")(MyFarWindow)
    retried = elu_far_part("myfar")
    assert FAR_PART_REGISTRY["myfar"] is retried and ATTENTION_REGISTRY["myfar_window"] is retried.layer_class


def test_a_taken_far_part_name_is_refused_before_anything_changes():
    original = elu_far_part("taken")
    with pytest.raises(ValueError, match=re.escape("far part name 'taken' is already registered to EluFarPart (module "
                                                   f"{__name__}); give EluFarPart another name in "
                                                   "@register_far_part.")):
        elu_far_part("taken")
    assert FAR_PART_REGISTRY["taken"] is original and ATTENTION_REGISTRY["taken_window"] is original.layer_class


def test_decorating_the_same_class_again_changes_nothing():
    far_part = elu_far_part("twice")
    layer_class = far_part.layer_class
    assert register_far_part("twice")(far_part) is far_part
    assert far_part.layer_class is layer_class and ATTENTION_REGISTRY["twice_window"] is layer_class


# -- the outputs' shapes ------------------------------------------------------------------------------------------
def window_config():
    return ZooWindowConfig(attn_layers=["full"], is_decoder=True, window_size=3, num_sink_tokens=1, hidden_size=16,
                           num_attention_heads=2, num_hidden_layers=1, vocab_size=20, intermediate_size=32)


def run_form(attn, form: str):
    """Run the windowed layer `attn` in one form on 2 x 9 tokens (the step form: a prefill of 8, then one token)."""
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0))
    if form == "reference":
        return attn.reference_forward(x)
    if form == "parallel":
        return attn(x)
    cache = ZooCache([attn.new_cache_layer()])
    attn(x[:, :8], attention_mask=torch.ones(2, 8, dtype=torch.bool), cache=cache)
    return attn(x[:, 8:], attention_mask=torch.ones(2, 9, dtype=torch.bool), cache=cache)


CONTRACT = "it must return a FarOutput (or three tensors: numerator, denominator, log scale) of shapes {}"


@pytest.mark.parametrize("form, defect, got, expected", [
    # a numerator one value wider than the values: a bare torch size error before
    pytest.param("parallel", lambda out: out._replace(num=torch.cat([out.num, out.num[..., :1]], -1)),
                 "shapes [2, 2, 9, 9], [2, 2, 9], [2, 2, 9]", "[2, 2, 9, 8], [2, 2, 9], [2, 2, 9]",
                 id="parallel-numerator-too-wide"),
    # a denominator summed over the heads, kept as one: broadcast silently over the heads before
    pytest.param("step", lambda out: out._replace(den=out.den.sum(1, keepdim=True)),
                 "shapes [2, 2, 1, 8], [2, 1, 1], [2, 2, 1]", "[2, 2, 1, 8], [2, 2, 1], [2, 2, 1]",
                 id="step-denominator-one-head"),
    # the log scale with queries and heads swapped
    # (a plain triple, as a far part without state may return)
    pytest.param("reference", lambda out: (*out[:2], out[2].transpose(1, 2)),
                 "shapes [2, 2, 9, 8], [2, 2, 9], [2, 9, 2]", "[2, 2, 9, 8], [2, 2, 9], [2, 2, 9]",
                 id="reference-log-scale-transposed"),
    pytest.param("parallel", lambda out: out[:2], "a tuple of 2", "[2, 2, 9, 8], [2, 2, 9], [2, 2, 9]",
                 id="parallel-two-outputs"),
])
def test_outputs_of_the_wrong_shape_are_refused_naming_the_far_part_and_the_shapes(form, defect, got, expected):
    elu_far_part("misshapen", {form: defect})
    attn = build_attention("misshapen_window", window_config(), 0, True)
    message = (f"far part EluFarPart (attention 'misshapen_window'): {form}() returned {got}; "
               + CONTRACT.format(expected))
    with pytest.raises(ValueError, match=re.escape(message)):
        run_form(attn, form)


@pytest.mark.parametrize("form", ["parallel", "step", "reference"])
def test_outputs_of_the_right_shape_pass_in_every_form(form):
    elu_far_part("well_shaped")
    out = run_form(build_attention("well_shaped_window", window_config(), 0, True), form)
    assert out.shape == (2, 1 if form == "step" else 9, 16) and out.isfinite().all()
