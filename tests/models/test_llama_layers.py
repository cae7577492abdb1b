"""The Llama options of the shared backbone (rotary positions, grouped-query heads, RMSNorm, gated feed-forward,
bias switches) in every attention kind: fast paths against reference paths, grouped heads against the same model
with repeated key/value weights, rotary's relative-position property, the switches' checks, and that a checkpoint
saved before these options existed loads unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from attnzoo import ZooConfig, ZooHybridConfig, ZooHybridForCausalLM, ZooSoftmaxConfig, ZooSoftmaxForCausalLM
from attnzoo.configuration.rope import inverse_frequencies
from attnzoo.modeling.attention import InitialisesBuffers, build_attention
from attnzoo.modeling.normalization import RMSNorm
from tests.models.test_family_hybrid import LLAMA_LAYER

KINDS = ["full", "favor", "elu", "ra", "lara", "local", "lsh"]
#: the kinds with an exact window inside the layer (decoders only); hybrid_config's window of 3 tokens and 1 sink
#: leaves far keys for the family's own part in every test sequence
WINDOWED_KINDS = ["favor_window", "lara_window", "ra_window", "lsh_window"]
#: the modules of each attention kind whose heads are key/value heads (the rest are query heads)
KEY_VALUE_PROJECTIONS = {"local": ("key", "value"), "lsh": ("value",), "lsh_window": ("value",)}


def hybrid_config(**overrides):
    values = dict(LLAMA_LAYER, vocab_size=41, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, hidden_dropout_prob=0.0, num_random_features=16,
                  linear_attention_chunk_size=4, lsh_chunk_length=4, lsh_num_buckets=4,
                  lsh_full_attention_threshold=0, local_chunk_length=4, lara_num_samples=4, lara_chunk_size=3,
                  window_size=3, num_sink_tokens=1, pad_token_id=0, is_decoder=True)
    values.update(overrides)
    return ZooHybridConfig(**values)


@pytest.mark.parametrize("kind, causal", [(kind, causal) for kind in KINDS for causal in (True, False)]
                         + [(kind, True) for kind in WINDOWED_KINDS])
def test_rotary_grouped_attention_fast_path_equals_reference(kind, causal):
    torch.manual_seed(0)
    attn = build_attention(kind, hybrid_config(), 0, causal).double().eval()
    if isinstance(attn, InitialisesBuffers):  # built outside a model, so no _init_weights fills its buffers
        attn.init_buffers()
    x = torch.randn(2, 11, 32, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(3, 14)[None].expand(2, -1)  # not starting at 0: the rotation must use them
    fast = attn(x, position_ids=positions)
    ref = attn.reference_forward(x, position_ids=positions)
    torch.testing.assert_close(fast, ref, rtol=1e-8, atol=1e-9)
    grad_fast, = torch.autograd.grad(fast.square().sum(), x)
    grad_ref, = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(grad_fast, grad_ref, rtol=1e-7, atol=1e-8)
    # and the positions matter: other relative positions give another output
    assert not torch.allclose(attn(x, position_ids=positions * 2), fast, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS + WINDOWED_KINDS)
def test_grouped_heads_equal_full_heads_with_repeated_key_value_weights(kind):
    """A model with 2 key/value heads for 4 query heads computes what a 4-head model computes when each of its
    key/value heads is a copy of its group's: the grouping is exactly weight sharing."""
    torch.manual_seed(0)
    grouped = ZooHybridForCausalLM(hybrid_config(attn_layers=[kind])).eval()
    full = ZooHybridForCausalLM(hybrid_config(attn_layers=[kind], num_key_value_heads=4)).eval()
    state = grouped.state_dict()
    head_dim = 32 // 4
    for name, tensor in state.items():
        module = name.rsplit(".", 2)[-2]
        if ".attn." in name and module in KEY_VALUE_PROJECTIONS.get(kind, ("k_proj", "v_proj")):
            # [2 * head_dim, ...] -> each head repeated twice, in order: query heads 0,1 read kv head 0
            heads = tensor.view(2, head_dim, *tensor.shape[1:])
            state[name] = heads.repeat_interleave(2, dim=0).reshape(4 * head_dim, *tensor.shape[1:])
    full.load_state_dict(state)
    ids = torch.randint(1, 41, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(grouped(ids).logits, full(ids).logits, rtol=1e-5, atol=1e-5)
    # and the grouped model is smaller
    assert sum(p.numel() for p in grouped.parameters()) < sum(p.numel() for p in full.parameters())


@pytest.mark.parametrize("kind", ["full", "local"])
def test_rotary_attention_depends_on_relative_positions_only(kind):
    """Exact attentions (softmax, and local windows, which are exact inside the window) see q·k through the relative
    rotation only: shifting every position by the same amount changes nothing."""
    torch.manual_seed(0)
    attn = build_attention(kind, hybrid_config(), 0, True).double().eval()
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    positions = torch.arange(9)[None]
    torch.testing.assert_close(attn(x, position_ids=positions), attn(x, position_ids=positions + 37))


def test_llama_style_model_decodes_left_padded_prompts_like_each_alone():
    torch.manual_seed(0)
    model = ZooHybridForCausalLM(hybrid_config(attn_layers=["full", "favor", "lsh", "lara", *WINDOWED_KINDS],
                                               num_hidden_layers=8)).eval()
    prompts = [torch.randint(1, 41, (n,)) for n in (9, 6)]
    batch = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, 9 - len(prompt):], mask[row, 9 - len(prompt):] = prompt, 1
    together = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert together[row, 9:].tolist() == alone[0, len(prompt):].tolist()


def test_rmsnorm_and_gated_feed_forward_compute_llamas_formulas():
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 6, dtype=torch.float64)
    norm = norm.double()
    torch.testing.assert_close(norm(x), norm.weight * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    model = ZooSoftmaxForCausalLM(ZooSoftmaxConfig(**{k: v for k, v in hybrid_config().to_diff_dict().items()
                                                      if k in ZooConfig.__dataclass_fields__ and k != "attn_layers"}))
    ffn = model.model.transformer.blocks[0].ffn
    assert [n for n, _ in ffn.named_parameters()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    h = torch.randn(2, 32)
    expected = ffn.down_proj(torch.nn.functional.silu(ffn.gate_proj(h)) * ffn.up_proj(h))
    torch.testing.assert_close(ffn(h), expected)


def test_bias_switches_follow_the_config():
    model = ZooHybridForCausalLM(hybrid_config(attn_layers=["full", "local"]))
    names = {n for n, _ in model.named_parameters()}
    for block, (q, o) in enumerate([("q_proj", "o_proj"), ("query", "output")]):
        assert f"model.transformer.blocks.{block}.attn.{q}.bias" in names
        assert f"model.transformer.blocks.{block}.attn.{o}.bias" not in names
    assert not any(".ffn." in n and n.endswith(".bias") for n in names)
    assert not any("norm" in n and n.endswith(".bias") for n in names)  # RMSNorm has none


def test_rope_scaling_inverse_frequencies():
    base = inverse_frequencies(10000.0, 8, None)
    torch.testing.assert_close(base, 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    torch.testing.assert_close(inverse_frequencies(10000.0, 8, {"rope_type": "linear", "factor": 4.0}), base / 4)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    scaled = inverse_frequencies(10000.0, 8, llama3)
    wavelength = 2 * torch.pi / base
    assert torch.equal(scaled[wavelength < 64 / 4], base[wavelength < 64 / 4])  # short wavelengths kept
    torch.testing.assert_close(scaled[wavelength > 64], base[wavelength > 64] / 8)  # long ones interpolated


@pytest.mark.parametrize("values, field", [
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_key_value_heads=0), "num_key_value_heads"),
    (dict(norm_type="batchnorm"), "norm_type"),
    (dict(mlp_type="moe"), "mlp_type"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.5}), "rope_scaling"),
    (dict(rope_scaling="linear"), "rope_scaling"),
])
def test_bad_llama_options_raise_value_error_naming_the_field(values, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        ZooSoftmaxConfig(position_embedding_type="rotary", num_attention_heads=4, **values)


def test_a_checkpoint_saved_before_these_options_loads_with_the_same_logits(tmp_path):
    """Configs written before the Llama options have none of their keys: the defaults must rebuild the same model
    (LayerNorm, standard feed-forward with biases, one key/value head per query head, learned positions)."""
    torch.manual_seed(0)
    model = ZooSoftmaxForCausalLM(ZooSoftmaxConfig(is_decoder=True, num_hidden_layers=2, hidden_size=32,
                                                   num_attention_heads=4, vocab_size=41)).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    new_keys = ("attention_output_bias", "num_key_value_heads", "norm_type", "mlp_type", "mlp_bias", "rope_theta",
                "rope_scaling")
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in new_keys}))
    old_names = {"fc_in", "fc_out", "attn_norm", "ffn_norm", "q_proj", "k_proj", "v_proj", "o_proj"}
    assert {n.split(".")[-2] for n in model.state_dict() if ".blocks." in n} == old_names
    loaded = ZooSoftmaxForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 41, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_an_attention_without_position_ids_is_refused_in_a_rotary_model():
    from attnzoo.modeling.attention import ATTENTION_REGISTRY, ZooAttention, register_attention

    @register_attention("test_positionless")
    class Positionless(ZooAttention):
        def forward(self, hidden_states, attention_mask=None, cache=None):
            return hidden_states

    try:
        with pytest.raises(ValueError, match=r"takes no position_ids.*docs/adding_an_attention.md"):
            ZooHybridForCausalLM(hybrid_config(attn_layers=["test_positionless"]))
        ZooHybridForCausalLM(hybrid_config(attn_layers=["test_positionless"], position_embedding_type="learned"))
    finally:
        del ATTENTION_REGISTRY["test_positionless"]


def test_a_rope_scaling_given_to_from_pretrained_is_checked_not_ignored(tmp_path):
    """from_pretrained(..., rope_scaling=...) sets the value after the config checked itself; the model checks it
    again, so a refused scaling (dynamic NTK) raises instead of leaving the rotations unscaled."""
    from transformers import AutoModelForCausalLM

    from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM

    config = ZooSoftmaxConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, is_decoder=True, position_embedding_type="rotary")
    ZooSoftmaxForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"rope_scaling.*'dynamic' is not supported"):
        AutoModelForCausalLM.from_pretrained(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    linear = AutoModelForCausalLM.from_pretrained(tmp_path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert linear.config.rope_scaling["factor"] == 2.0


def test_a_saved_config_loads_in_transformers_own_config_class_without_a_warning(tmp_path):
    """`AutoTokenizer.from_pretrained(folder)` reads config.json with transformers' PreTrainedConfig, which takes a
    saved `rope_scaling` for its deprecated alias and warns: rope_scaling None (the default) is not saved; a scaling
    is, and loads back."""
    import warnings

    from transformers import AutoConfig, PreTrainedConfig

    plain, scaled = tmp_path / "plain", tmp_path / "scaled"
    ZooSoftmaxConfig(**LLAMA_LAYER, is_decoder=True).save_pretrained(plain)
    linear = {"rope_type": "linear", "factor": 2.0}
    ZooSoftmaxConfig(**LLAMA_LAYER, is_decoder=True, rope_scaling=linear).save_pretrained(scaled)
    assert "rope_scaling" not in json.loads((plain / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PreTrainedConfig.from_pretrained(plain)
    assert AutoConfig.from_pretrained(plain).rope_scaling is None
    assert AutoConfig.from_pretrained(scaled).rope_scaling == linear
