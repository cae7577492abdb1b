"""Keys and values stored in 8 or 4 bits (`kv_quantisation`) and block retrieval's quantised far store: the round
trip is within half a step of each entry, codes are what the rule says, the gradient is the identity; a quantised
`block_window` reads exactly the keys and values its unquantised self reads after the round trip, and its decoding
state holds codes (a quarter or an eighth of the float32 bytes). Reference = fast path, decoding = full forward,
left padding and remote code for the quantised store run in tests/attention/test_far_part_conformance.py."""

from __future__ import annotations

import pytest
import torch

from attnzoo import ZooHybridForCausalLM
from attnzoo.modeling.attention import build_attention
from attnzoo.modeling.attention.kv_quantisation import dequantise, quantise, round_trip
from attnzoo.modeling.attention.windowed import FarInputs, far_state
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import block_config as config


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_round_trip_is_within_half_a_step_of_every_entry(bits, dtype):
    x = torch.randn(2, 3, 50, 16, dtype=dtype, generator=torch.Generator().manual_seed(0)) * 3
    codes, ranges = quantise(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 50, 16 * bits // 8)
    assert ranges.dtype == dtype and ranges.shape == (2, 3, 50, 2)
    scale, low = ranges[..., :1], ranges[..., 1:]
    torch.testing.assert_close(low, x.amin(-1, keepdim=True), rtol=0, atol=0)
    torch.testing.assert_close(scale, (x.amax(-1, keepdim=True) - low) / (2 ** bits - 1), rtol=0, atol=0)
    back = dequantise(codes, ranges, bits)
    step = scale.expand_as(x)
    # half a step, and the float rounding of codes * scale + low (which grows with the entries, not the step)
    assert ((back - x).abs() <= step / 2 + 4 * torch.finfo(dtype).eps * x.abs().amax(-1, keepdim=True)).all()
    assert ((back - x).abs() > step / 100).any()  # it does round: the store is not exact
    assert torch.equal(round_trip(x, bits), back)
    assert round_trip(x, None) is x


def test_codes_are_the_nearest_levels_and_four_bit_codes_pack_two_a_byte():
    x = torch.tensor([[0.0, 1.0, 2.0, 15.0, 7.4, 7.6]])  # low 0, scale 1 in 4 bits
    codes, ranges = quantise(x, 4)
    assert codes.tolist() == [[0 | 1 << 4, 2 | 15 << 4, 7 | 8 << 4]]
    assert ranges.tolist() == [[1.0, 0.0]]
    assert dequantise(codes, ranges, 4).tolist() == [[0.0, 1.0, 2.0, 15.0, 7.0, 8.0]]
    constant = torch.full((1, 4), -2.5)
    assert torch.equal(round_trip(constant, 8), constant)


def test_the_gradient_of_the_round_trip_is_the_identity():
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(4, 8, dtype=torch.float64)
    (round_trip(x, 4) * weights).sum().backward()
    torch.testing.assert_close(x.grad, weights, rtol=0, atol=0)


@pytest.mark.parametrize(("key_bits", "value_bits"), [(8, 4), (4, 8), (8, None)])
def test_a_quantised_store_reads_the_round_tripped_keys_and_values(key_bits, value_bits):
    """The far triple of the quantised far part is the unquantised far part's over the round-tripped keys and
    values, and differs from the unquantised one over the keys themselves."""
    torch.manual_seed(0)
    plain = build_attention("block_window", config(), 0, True).double().eval()
    quantised = build_attention("block_window", config(block_key_bits=key_bits, block_value_bits=value_bits), 0,
                                True).double().eval()
    q = torch.randn(1, 4, 40, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 40, 8, dtype=torch.float64), torch.randn(1, 2, 40, 8, dtype=torch.float64)
    position = torch.arange(40)[None]
    out = quantised.far.parallel(FarInputs(q, k, v, position < 40, position))
    same = plain.far.parallel(FarInputs(q, round_trip(k, key_bits), round_trip(v, value_bits), position < 40,
                                        position))
    exact = plain.far.parallel(FarInputs(q, k, v, position < 40, position))
    for a, b in zip(out[:3], same[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    far = torch.isfinite(exact.log_scale)
    assert (out.num - exact.num)[far].abs().max() > 1e-4


@pytest.mark.parametrize(("key_bits", "value_bits", "bytes_over_float32"), [(8, 4, (72 + 40) / 512),
                                                                            (8, 8, (72 + 72) / 512)])
def test_decoding_holds_codes_and_their_ranges(key_bits, value_bits, bytes_over_float32):
    """The far store of a float32 model holds uint8 codes (d or d / 2 bytes a token and head) and one (scale, low)
    pair per token and head: with head_dim 64, (64 + 8) and (32 + 8) bytes against 2 x 256. The cached generation
    equals the uncached one."""
    settings = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    model = {bits: ZooHybridForCausalLM(config(**settings, block_key_bits=bits[0], block_value_bits=bits[1])).eval()
             for bits in [(None, None), (key_bits, value_bits)]}
    model[(key_bits, value_bits)].load_state_dict(model[(None, None)].state_dict())
    ids = torch.randint(1, 37, (2, 30), generator=torch.Generator().manual_seed(0))
    stores = {}
    for bits, m in model.items():
        with torch.no_grad():
            out = m(ids, use_cache=True)
        state = far_state(output_cache(out).layers[0])
        stores[bits] = sum(t.numel() * t.element_size() for name, t in state.items()
                           if name in ("block_keys", "block_values", "block_key_ranges", "block_value_ranges"))
        if bits != (None, None):
            assert state["block_keys"].dtype == state["block_values"].dtype == torch.uint8
            assert state["block_keys"].shape[-1] == 64 * key_bits // 8
            assert state["block_values"].shape[-1] == 64 * value_bits // 8
            assert state["block_key_ranges"].shape[-1] == state["block_value_ranges"].shape[-1] == 2
    assert stores[(key_bits, value_bits)] / stores[(None, None)] == pytest.approx(bytes_over_float32)
    quantised = model[(key_bits, value_bits)]
    with torch.no_grad():
        cached = quantised.generate(ids[:, :20], max_new_tokens=6, do_sample=False)
        uncached = quantised.generate(ids[:, :20], max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.tolist() == uncached.tolist()


def test_decoding_stores_what_the_prefill_stores_and_sums_the_stored_keys():
    """The state after a prefill of 30 tokens, and after a prefill of 18 and 12 decoding steps: the same codes and
    ranges for every far token, and block key sums that are the sums of the stored keys read back (not of the keys
    as computed), block by block from the first far position."""
    torch.manual_seed(0)
    model = ZooHybridForCausalLM(config(num_hidden_layers=1, block_key_bits=8, block_value_bits=4)).double().eval()
    ids = torch.randint(1, 37, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = far_state(output_cache(model(ids, use_cache=True)).layers[0])
        out = model(ids[:, :18], use_cache=True)
        for t in range(18, 30):
            out = model(ids[:, t:t + 1], cache=output_cache(out), use_cache=True)
    stepped = far_state(output_cache(out).layers[0])
    gone, sinks, size = 30 - 4, 2, 3  # tokens that left the window of 4; sinks; block size
    for name in ("block_keys", "block_values"):
        assert torch.equal(whole[name][:, :, :gone], stepped[name][:, :, :gone]), name
    for name in ("block_key_ranges", "block_value_ranges"):
        torch.testing.assert_close(whole[name][:, :, :gone], stepped[name][:, :, :gone], rtol=1e-13, atol=1e-14)
    read = dequantise(whole["block_keys"][:, :, sinks:gone], whole["block_key_ranges"][:, :, sinks:gone], 8)
    blocks = -(-(gone - sinks) // size)
    read = torch.nn.functional.pad(read, (0, 0, 0, blocks * size - read.shape[2]))
    sums = read.view(*read.shape[:2], blocks, size, -1).sum(3)
    for state in (whole, stepped):
        torch.testing.assert_close(state["block_key_sums"][:, :, :blocks], sums, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bits", [2, 16, True])
def test_quantise_refuses_a_width_it_does_not_store(bits):
    with pytest.raises(ValueError, match=rf"bits={bits!r} is not a stored width: use one of \(8, 4\)"):
        quantise(torch.randn(2, 8), bits)
    with pytest.raises(ValueError, match="4-bit entries pack two a byte and the vectors have 7 entries"):
        quantise(torch.randn(2, 7), 4)
    codes, ranges = quantise(torch.randn(2, 8), 8)
    with pytest.raises(ValueError, match=rf"bits={bits!r} is not a stored width"):
        dequantise(codes, ranges, bits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_vectors_are_quantised_in_float32(dtype):
    """A range past float16's 65504 and bfloat16's coarse steps: the codes and ranges are computed in float32, and
    the round trip comes back in the input's dtype within half a step (and the input's own rounding)."""
    x = (torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 1.6e4).to(dtype)
    assert torch.isfinite(x).all() and (x.float().amax(-1) - x.float().amin(-1) > 65504).any()
    codes, ranges = quantise(x, 8)
    assert ranges.dtype == torch.float32 and torch.isfinite(ranges).all()
    back = round_trip(x, 8)
    assert back.dtype == dtype
    step = ranges[..., :1].expand(4, 16)
    error = (back.float() - x.float()).abs()
    assert (error <= step / 2 + x.float().abs() * torch.finfo(dtype).eps).all()


@pytest.mark.parametrize("field", ["block_key_bits", "block_value_bits"])
@pytest.mark.parametrize("bits", [2, 16, True, 8.0, "8"])
def test_bad_store_bits_are_refused_naming_the_field(field, bits):
    with pytest.raises(ValueError, match=rf"{field}={bits!r} is invalid: use one of \(8, 4\) bits an entry, as an int"):
        config(**{field: bits})


@pytest.mark.parametrize("field", ["block_key_bits", "block_value_bits"])
@pytest.mark.parametrize("layers", [["window"], ["lsh_window"], ["full", "window"]])
def test_store_bits_without_block_retrieval_are_refused_not_ignored(field, layers):
    with pytest.raises(ValueError, match=rf"{field}=8 is invalid: it stores block retrieval's far keys and values, "
                                         r"and no layer has block retrieval; list 'block_window' in attn_layers"):
        config(attn_layers=layers, **{field: 8})
    assert config(attn_layers=["window", "block_window"], **{field: 8}).layer_attention_kinds()[1] == "block_window"


def test_the_configuration_allows_the_widths_the_store_has():
    """The configuration imports nothing of the models, so it keeps its own copy of the widths."""
    from attnzoo.configuration.block_retrieval import STORED_BITS
    from attnzoo.modeling.attention.kv_quantisation import STORE_BITS

    assert STORED_BITS == STORE_BITS


def test_four_bits_need_an_even_head_dim():
    with pytest.raises(ValueError, match=r"block_value_bits=4 is invalid: 4-bit entries pack two a byte and "
                                         r"head_dim=7 is odd: use 8 bits"):
        config(hidden_size=28, block_value_bits=4)
