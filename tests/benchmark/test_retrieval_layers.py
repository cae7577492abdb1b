"""attnzoo.evaluation.retrieval_layers: the probe's weights are the model's own (against transformers' eager
attention weights), its output is SDPA's (logits unchanged), the model's attention implementation is restored, the
calibration prompts keep the key far, the top layers make a layout the converter builds, and bad arguments name
themselves."""

from __future__ import annotations

import json
import math

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


# -- far-part attributions: the conversion's own far parts, gated ---------------------------------------------------
FAR = {"window_size": 64, "num_sink_tokens": 4, "far_positions": ["fixed"], "block_size": 16, "block_topk": 2}


def converted(folder, family="hybrid", **settings):
    from attnzoo.convert.llama import convert, load_source

    near = {k: settings.pop(k, FAR[k]) for k in ("window_size", "num_sink_tokens")}
    model = convert(load_source(str(folder)), family, {**FAR, **near, **settings} if family == "hybrid" else near)
    return model.double().eval()


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("one") / "llama", layers=1, positions=512)
    return folder, AutoTokenizer.from_pretrained(folder)


def answer_nll(model, prompt) -> float:
    ids = torch.tensor([prompt.input_ids + prompt.answer_ids])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, len(prompt.input_ids) - 1:-1]
    return float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt.input_ids):], reduction="sum"))


def test_a_closed_gate_is_the_window_only_layer_and_an_open_one_the_model(one_layer):
    folder, tokenizer = one_layer
    model, window = converted(folder, attn_layers=["block_window"]), converted(folder, "window")
    ids = torch.tensor([[i % 250 + 3 for i in range(300)]])
    with torch.no_grad():
        plain = model(ids).logits
        layers = rl.far_layers(model)
        assert list(layers) == [0] and rl.far_layers(window) == {}
        with rl.gated_far_parts(layers, {0: torch.zeros(4, dtype=torch.float64)}):
            torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)
        with rl.gated_far_parts(layers, {0: torch.full((4,), -math.inf, dtype=torch.float64)}):
            torch.testing.assert_close(model(ids).logits, window(ids).logits, rtol=1e-10, atol=1e-10)
        assert "parallel" not in vars(layers[0].far)  # the class's own form again
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)


def test_the_attributions_add_up_to_the_window_to_far_fall_of_the_answers_nll(one_layer):
    """One layer: nothing before its far part is gated, so the gradient is exact, and the integrated gradients of its
    heads sum to NLL(window only) - NLL(as converted) up to the midpoint rule's error (shrinking with the steps)."""
    folder, tokenizer = one_layer
    near = {"window_size": 16, "num_sink_tokens": 1}  # a short window: most of the answer's attention is far
    model = converted(folder, attn_layers=["block_window"], block_size=8, block_topk=8, **near)
    window = converted(folder, "window", **near)
    settings = dict(length=400, min_distance=100, prompts=2, seed=3)
    prompts = rl.calibration_prompts(tokenizer, **settings)
    fall = sum(answer_nll(window, p) - answer_nll(model, p) for p in prompts) / len(prompts)
    errors = []
    for steps in (4, 32):
        result = rl.far_part_attributions(model, tokenizer, steps=steps, **settings)
        assert result["far_layers"] == [0] and len(result["head_scores"][0]) == 4
        assert result["layer_scores"][0] == pytest.approx(sum(result["head_scores"][0]))
        errors.append(abs(result["layer_scores"][0] - fall))
    assert abs(fall) > 0.005  # the far part moves this (random) model's answer: the check can fail
    assert errors[1] < 0.01 * abs(fall) and errors[1] < errors[0]
    assert all(p.requires_grad for p in model.parameters())  # the model is left trainable, as it was
    assert "parallel" not in vars(rl.far_layers(model)[0].far)


def test_attributions_rank_the_far_layers_and_the_cli_makes_their_layout(tiny, tmp_path):
    folder, _, tokenizer = tiny
    from attnzoo.convert.common import load_text_tokenizer, save_converted

    target = save_converted(converted(folder, attn_layers=["block_window"]).float(), tmp_path / "far",
                            [load_text_tokenizer(str(folder))])
    out = tmp_path / "attributions.json"
    result = rl.main([str(target), "--method", "attribution", "--length", "400", "--min_distance", "100",
                      "--prompts", "1", "--steps", "2", "--top", "2", "--output", str(out)])
    assert result["method"] == "attribution" and result["far_layers"] == [0, 1, 2]
    assert result["top"] == rl.top_layers(result["layer_scores"], 2)
    assert result["attn_layers"].count("block_window") == 2
    assert json.loads(out.read_text())["top"] == result["top"]
    with pytest.raises(ValueError, match="no layer with a far part"):
        rl.far_part_attributions(converted(folder, "window"), tokenizer, length=400, min_distance=100)
    with pytest.raises(ValueError, match="steps=0"):
        rl.far_part_attributions(converted(folder, attn_layers=["block_window"]), tokenizer, length=400,
                                 min_distance=100, steps=0)


def test_the_cli_lays_out_the_conversions_own_far_part_unless_told(tiny, tmp_path):
    """An LSH conversion's attribution layout keeps lsh_window and its far positions (not the attention method's
    block_window / fixed defaults); layers that differ ask for the flag."""
    folder, _, _ = tiny
    from attnzoo.convert.common import load_text_tokenizer, save_converted

    lsh = {"lsh_shared_qk": False, "lsh_num_hashes": 2, "lsh_chunk_length": 16, "far_positions": ["none"]}
    target = save_converted(converted(folder, attn_layers=["lsh_window"], **lsh).float(), tmp_path / "lsh",
                            [load_text_tokenizer(str(folder))])
    flags = ["--method", "attribution", "--length", "400", "--min_distance", "100", "--prompts", "1", "--steps", "1",
             "--top", "2"]
    result = rl.main([str(target), *flags])
    assert result["attn_layers"].count("lsh_window") == 2 and "block_window" not in result["attn_layers"]
    assert [result["far_positions"][i] for i in result["top"]] == ["none", "none"]
    told = rl.main([str(target), *flags, "--far_positions", "fixed"])
    assert [told["far_positions"][i] for i in told["top"]] == ["fixed", "fixed"]
    mixed = save_converted(converted(folder, attn_layers=["lsh_window", "block_window", "lsh_window"], **lsh,
                                     block_size=16, block_topk=2).float(), tmp_path / "mixed",
                           [load_text_tokenizer(str(folder))])
    with pytest.raises(ValueError, match="--far_kind"):
        rl.main([str(mixed), *flags, "--top", "3"])
    assert rl.main([str(mixed), *flags, "--top", "3", "--far_kind", "lsh_window"])["attn_layers"] == ["lsh_window"] * 3


def test_key_value_heads_rank_by_their_query_heads_and_make_a_far_kv_heads_layout():
    head_scores = [[0.1, 0.2, 0.3, -0.4], [0.5, -0.5, 0.05, 0.0]]  # 2 layers x 4 query heads over 2 key-value heads
    summed = rl.kv_head_scores(head_scores, 2, "attribution")
    for got, expected in ((summed, [[0.3, -0.1], [0.0, 0.05]]),
                          (rl.kv_head_scores(head_scores, 2, "attention"), [[0.2, 0.3], [0.5, 0.05]])):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))
    assert rl.top_kv_heads(summed, 2) == {0: [0], 1: [1]}
    assert rl.top_kv_heads(summed, 3) == {0: [0], 1: [0, 1]}
    assert rl.top_kv_heads([[1.0, 1.0], [1.0, 1.0]], 3) == {0: [0, 1], 1: [0]}  # ties: the earlier layer, then head
    result = rl.head_layout(3, {0: [0], 1: [0, 1]}, 2, "block_window", far_positions="fixed")
    assert result == {"attn_layers": ["block_window", "block_window", "window"],
                      "far_positions": ["fixed", "fixed", "rotary"], "far_kv_heads": [[0], None, None]}
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        rl.kv_head_scores(head_scores, 3, "attribution")
    with pytest.raises(ValueError, match="kv_heads=5"):
        rl.top_kv_heads(summed, 5)


def test_the_cli_lays_out_the_top_key_value_heads_and_the_gates_follow_them(tiny, tmp_path):
    """--kv_heads: the far part in the best key-value heads only (`far_kv_heads`), a layout the converter builds;
    attributing a conversion that keeps some heads gates those heads alone (a closed gate: the window model)."""
    folder, _, tokenizer = tiny
    from attnzoo.convert.common import load_text_tokenizer, save_converted

    target = save_converted(converted(folder, attn_layers=["block_window"]).float(), tmp_path / "far",
                            [load_text_tokenizer(str(folder))])
    result = rl.main([str(target), "--method", "attribution", "--length", "400", "--min_distance", "100",
                      "--prompts", "1", "--steps", "1", "--kv_heads", "2"])
    chosen = rl.top_kv_heads(rl.kv_head_scores(result["head_scores"], 2, "attribution"), 2)
    assert result["top_kv_heads"] == chosen and result["top"] == sorted(chosen)
    assert sum(len(h) if h is not None else 2 for i, h in enumerate(result["far_kv_heads"]) if i in chosen) == 2
    model = converted(folder, **{k: result[k] for k in ("attn_layers", "far_positions", "far_kv_heads")})
    assert {i: layer.far_kv_heads or [0, 1] for i, layer in rl.far_layers(model).items()} == chosen
    ids = torch.tensor([[i % 250 + 3 for i in range(300)]])
    with torch.no_grad():
        closed = {i: torch.full((4,), -math.inf, dtype=torch.float64) for i in rl.far_layers(model)}
        with rl.gated_far_parts(rl.far_layers(model), closed):
            torch.testing.assert_close(model(ids).logits, converted(folder, "window")(ids).logits, rtol=1e-10,
                                       atol=1e-10)
