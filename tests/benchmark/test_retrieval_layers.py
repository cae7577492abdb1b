"""attnzoo.evaluation.retrieval_layers: the probe's weights are the model's own (against transformers' eager
attention weights), its output is SDPA's (logits unchanged), the model's attention implementation is restored, the
calibration prompts keep the key far, the top layers make a layout the converter builds, and bad arguments name
themselves."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnzoo.evaluation import retrieval_layers as rl
from attnzoo.evaluation.passkey import passkey_prompt
from attnzoo.transformers_compat import attention_implementation
from tests.scripts_helpers import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=3, positions=512)
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def eager_scores(folder, tokenizer, length, min_distance, prompts, seed=0):
    """The same scores from transformers' eager attention weights (output_attentions) of whole prompts."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    first = passkey_prompt(tokenizer, length, 0.0, seed)
    room = first.filler_tokens - min_distance
    per_layer = torch.zeros(model.config.num_hidden_layers, dtype=torch.float64)
    for index, fraction in enumerate(rl.calibration_depths(prompts)):
        prompt = passkey_prompt(tokenizer, length, fraction * room / first.filler_tokens, seed * 100_003 + index)
        ids = prompt.input_ids + prompt.answer_ids
        with torch.no_grad():
            attentions = model(torch.tensor([ids]), output_attentions=True).attentions
        rows = slice(len(prompt.input_ids) - 1, len(ids) - 1)
        for layer, weights in enumerate(attentions):  # [1, H, L, L]
            mass = weights[0, :, rows, prompt.key_position:prompt.key_end].sum(-1).mean(-1)  # [H]
            per_layer[layer] += mass.max().double()
    return (per_layer / prompts).tolist()


def test_the_scores_are_the_models_own_attention_weights_and_its_output_is_unchanged(tiny):
    folder, model, tokenizer = tiny
    ids = torch.tensor([[i % 250 + 3 for i in range(300)]])
    with torch.no_grad():
        before = model(ids).logits
    result = rl.retrieval_scores(model, tokenizer, length=400, min_distance=100, prompts=3)
    assert result["layer_scores"] == pytest.approx(eager_scores(folder, tokenizer, 400, 100, 3), rel=1e-4, abs=1e-6)
    assert len(result["head_scores"]) == 3 and len(result["head_scores"][0]) == 4
    assert all(p["distance"] >= 100 for p in result["prompts"])  # every key line at least min_distance back
    assert len({p["key_position"] for p in result["prompts"]}) == 3  # at three depths
    assert attention_implementation(model) == "sdpa"  # switched back
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    # the probe's own output is the layer's SDPA output: the model's logits under it equal the model's
    from transformers import AttentionInterface

    AttentionInterface.register(rl.PROBE, rl._probe_attention)
    prompt = passkey_prompt(tokenizer, 300, 0.3, 0)
    rl._RECORD.update(layers={}, span=(prompt.key_position, prompt.key_end), rows=[298])
    model.set_attn_implementation(rl.PROBE)
    try:
        with torch.no_grad():
            probed = model(torch.tensor([prompt.input_ids])).logits
    finally:
        model.set_attn_implementation("sdpa")
        rl._RECORD.clear()
    with torch.no_grad():
        torch.testing.assert_close(probed, model(torch.tensor([prompt.input_ids])).logits, rtol=1e-5, atol=1e-5)


def test_the_top_layers_make_a_layout_the_converter_builds(tiny, tmp_path):
    folder, _, _ = tiny
    assert rl.top_layers([0.1, 0.5, 0.2, 0.5], 2) == [1, 3] and rl.top_layers([0.3, 0.3], 1) == [0]
    assert rl.layout(4, [1, 3]) == {"attn_layers": ["window", "block_window", "window", "block_window"],
                                    "far_positions": ["rotary", "fixed", "rotary", "fixed"]}
    out = tmp_path / "scores.json"
    result = rl.main([str(folder), "--length", "400", "--min_distance", "100", "--prompts", "2", "--top", "1",
                      "--output", str(out)])
    assert json.loads(out.read_text())["attn_layers"] == result["attn_layers"]
    assert result["attn_layers"].count("block_window") == 1 and result["attn_layers"].count("window") == 2
    from attnzoo.convert.llama import convert, load_source

    model = convert(load_source(str(folder)), "hybrid", {"attn_layers": result["attn_layers"], "window_size": 64,
                                                         "num_sink_tokens": 4, "far_positions": result["far_positions"],
                                                         "block_size": 16, "block_topk": 2})
    assert list(model.config.attn_layers) == result["attn_layers"]
    with torch.no_grad():  # far keys (past 64 + 4) reach the block layer
        assert torch.isfinite(model(torch.tensor([list(range(3, 200))])).logits).all()
    with pytest.raises(SystemExit, match="--output"):  # an earlier result is never overwritten
        rl.main([str(folder), "--length", "400", "--output", str(out)])


@pytest.mark.parametrize("kwargs, says", [({"length": 1000}, "length=1000"), ({"min_distance": 390}, "min_distance"),
                                          ({"prompts": 0}, "prompts=0")])
def test_bad_calibrations_name_the_argument(tiny, kwargs, says):
    _, model, tokenizer = tiny
    settings = {"length": 400, "min_distance": 100, "prompts": 2, **kwargs}
    with pytest.raises(ValueError, match=says):
        rl.retrieval_scores(model, tokenizer, **settings)
    assert attention_implementation(model) == "sdpa"
    with pytest.raises(ValueError, match="top=4"):
        rl.top_layers([0.1, 0.2, 0.3], 4)
    with pytest.raises(ValueError, match="far layers"):
        rl.layout(3, [3])
