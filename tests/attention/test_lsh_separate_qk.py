"""Plain "lsh" layers with separate queries and keys (`lsh_shared_qk=False`): what a converted Llama keeps."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from attnzoo import ZooReformerConfig, ZooReformerForCausalLM
from attnzoo.modeling.attention.lsh import LSHAttention
from attnzoo.modeling.attention.lsh_window import SeparateQKLSHAttention
from attnzoo.modeling.attention.windowed import WindowedAttention
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import assert_cached_decoding_equals_full_forward


def config(**overrides):
    values = dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=32, max_position_embeddings=128, lsh_chunk_length=4, lsh_num_buckets=4,
                  lsh_num_hashes=2, lsh_hash_seed=7, attn_layers=["lsh"], lsh_shared_qk=False, is_decoder=True,
                  position_embedding_type="rotary", hidden_dropout_prob=0.0, pad_token_id=0, eos_token_id=None)
    values.update(overrides)
    return ZooReformerConfig(**values)


def left_padded(batch_lengths, length, generator):
    ids = torch.randint(2, 37, (len(batch_lengths), length), generator=generator)
    mask = torch.zeros(len(batch_lengths), length, dtype=torch.long)
    for row, n in enumerate(batch_lengths):
        mask[row, length - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def test_an_lsh_layer_with_separate_qk_keeps_four_projections_and_is_lsh_window_with_a_window_of_one():
    torch.manual_seed(0)
    layer = LSHAttention(config(), 0, causal=True).double()
    assert isinstance(layer, SeparateQKLSHAttention) and layer.name == "lsh"
    assert sorted(name for name, _ in layer.named_parameters()) == [
        "k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight"]
    # the same layer, written as lsh_window with one token of window and no sinks
    window = WindowedAttention.__subclasses__()  # registered layer classes, lsh_window's among them
    lsh_window = next(cls for cls in window if cls.name == "lsh_window")(
        config(window_size=1, num_sink_tokens=0), 0, causal=True).double()
    lsh_window.load_state_dict(layer.state_dict())
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0
    torch.testing.assert_close(layer(x, mask), lsh_window(x, mask), rtol=0, atol=0)


@pytest.mark.parametrize("rounds", [1, 3])
def test_fast_path_equals_its_reference_in_values_and_gradients(rounds):
    torch.manual_seed(1)
    layer = LSHAttention(config(lsh_num_hashes=rounds, lsh_num_buckets=8), 0, causal=True).double()
    x = torch.randn(2, 70, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[0, :11] = 0
    fast, reference = layer(x, mask), layer.reference_forward(x, mask)
    real = mask.bool()[..., None]
    torch.testing.assert_close(fast * real, reference * real, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(fast) * real
    grads = [torch.autograd.grad((out * weights).sum(), [x, *layer.parameters()]) for out in (fast, reference)]
    for fast_grad, reference_grad in zip(*grads, strict=True):
        torch.testing.assert_close(fast_grad, reference_grad, rtol=1e-9, atol=1e-11)


def test_with_every_key_a_candidate_it_is_exact_softmax_attention(monkeypatch):
    # With K = chunk length >= the sequence a round lists every earlier key of the query's bucket. Two buckets: a key
    # is missed only when it falls in the other bucket in every round, so the error against exact causal softmax (the
    # same projections, q.k / sqrt(d)) falls as the rounds grow; zero rotations put every vector in bucket 0, and then
    # it is exact softmax attention.
    torch.manual_seed(2)
    layer = LSHAttention(config(lsh_num_buckets=2, lsh_num_hashes=16, lsh_chunk_length=32,
                                position_embedding_type="learned"), 0, causal=True).double().eval()
    x = torch.randn(1, 24, 32, dtype=torch.float64)
    q, k, v = (layer.split_heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    exact = layer.o_proj(layer.merge_heads(F.scaled_dot_product_attention(
        q, layer.expand_kv(k), layer.expand_kv(v), is_causal=True)))
    errors = []
    for rounds in (1, 4, 16):
        layer.far.num_hashes_train = layer.far.num_hashes_eval = rounds
        errors.append(((layer(x) - exact).norm() / exact.norm()).item())
    assert all(later < 0.5 * earlier for earlier, later in itertools.pairwise(errors)), errors
    draw = type(layer.far).draw_rotations
    monkeypatch.setattr(type(layer.far), "draw_rotations", lambda self, *args: torch.zeros_like(draw(self, *args)))
    torch.testing.assert_close(layer(x), exact, rtol=1e-10, atol=1e-12)


def test_cached_decoding_and_generation_equal_the_full_forward_with_left_padding():
    torch.manual_seed(3)
    model = ZooReformerForCausalLM(config(num_hidden_layers=2, lsh_hash_seed=None)).double().eval()
    generator = torch.Generator().manual_seed(3)
    assert_cached_decoding_equals_full_forward(model, torch.randint(2, 37, (2, 40), generator=generator), 17)
    ids, mask = left_padded([12, 7], 12, generator)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, attention_mask=mask, use_cache=True, **kwargs)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_decoding_state_is_a_kv_cache_and_bucket_indices():
    torch.manual_seed(4)
    model = ZooReformerForCausalLM(config(num_hidden_layers=1, hidden_size=256, lsh_num_buckets=None,
                                          max_position_embeddings=2048, lsh_hash_seed=None)).eval()
    cache = output_cache(model(torch.randint(2, 37, (1, 1000)), use_cache=True))
    for _ in range(3):
        cache = output_cache(model(torch.randint(2, 37, (1, 1)), cache=cache, use_cache=True))
    layer = cache.layers[0]
    head_dim, kv_heads = 64, 2
    kv_bytes = 1003 * 2 * kv_heads * head_dim * 4
    held = sum(t.numel() * t.element_size() for t in layer.state.values())
    assert held <= 1.05 * kv_bytes, (held, kv_bytes, {n: tuple(t.shape) for n, t in layer.state.items()})


def test_settings_it_cannot_honour_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="lsh_full_attention_threshold=8 .*set lsh_full_attention_threshold=0"):
        LSHAttention(config(lsh_full_attention_threshold=8), 0, causal=True)
    with pytest.raises(ValueError, match="causal .*set lsh_shared_qk=True"):
        LSHAttention(config(), 0, causal=False)
    LSHAttention(config(lsh_full_attention_threshold=0), 0, causal=True)


def test_save_and_load_through_the_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = ZooReformerForCausalLM(config()).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(2, 37, (1, 30))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert isinstance(loaded.model.transformer.blocks[0].attn, SeparateQKLSHAttention)


def test_the_checkpoint_loads_from_its_own_code_where_attnzoo_is_not_installed(tmp_path):
    # the layer is built through LSHAttention, which finds it once lsh_window is imported: the checkpoint's flat copy
    # of the code must carry and import that module too
    import subprocess
    import sys

    torch.manual_seed(6)
    model = ZooReformerForCausalLM(config()).eval()
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(2, 37, (1, 30))
    torch.save({"ids": ids, "logits": model(ids).logits.detach()}, tmp_path / "expected.pt")
    script = f"""
import sys
sys.modules["attnzoo"] = None  # as if attnzoo were not installed
import torch, transformers
torch.set_num_threads({torch.get_num_threads()})
expected = torch.load({str(tmp_path / "expected.pt")!r})
model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}, trust_remote_code=True).eval()
layer = model.model.transformer.blocks[0].attn
assert type(layer).__name__ == "SeparateQKLSHAttention" and "attnzoo" not in type(layer).__module__
with torch.no_grad():
    print((model(expected["ids"]).logits - expected["logits"]).abs().max().item())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert float(done.stdout.strip().splitlines()[-1]) == 0.0


@pytest.mark.parametrize("shared_qk", [True, False])
def test_deepcopy_and_pickle_give_the_same_layer(shared_qk):
    # LSHAttention chooses its layer in __new__, which copy.deepcopy and pickle call without arguments
    import copy
    import pickle

    torch.manual_seed(7)
    layer = LSHAttention(config(lsh_shared_qk=shared_qk, lsh_full_attention_threshold=0), 0, causal=True).eval()
    x = torch.randn(1, 20, 32)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(twin) is type(layer)
        torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
