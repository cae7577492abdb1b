"""The shared family suite for the Reformer family (LSH and local attention, reversible, axial positions)."""

import pytest
import torch

from attnzoo import ZooReformerConfig, ZooReformerForCausalLM
from attnzoo.modeling.attention.local import LocalAttention
from attnzoo.modeling.attention.lsh import LSHAttention
from attnzoo.transformers_compat import output_cache
from tests.attention.helpers import HIDDEN, config, lm_config, named
from tests.family_suite import FamilySuite


class TestReformerFamily(FamilySuite):
    config_class = ZooReformerConfig
    prefix = "ZooReformer"
    # Local chunks of 4 and LSH chunks of 8 make the suite's sequences span several chunks, so they really hash:
    # evaluation draws its rotations from `eval_seed` (one set for the whole batch), so comparisons of separate
    # forwards (cached vs uncached generation, a padded batch vs each row alone) hold with hashing too.
    config_overrides = dict(lsh_chunk_length=8, local_chunk_length=4)
    attention_patterns = [("local", "lsh"), ("lsh",), ("local",)]


# -- loading transformers' Reformer ----------------------------------------------------------------------------------
def transformers_reformer(**overrides):
    from transformers import ReformerConfig, ReformerModelWithLMHead

    values = dict(vocab_size=37, hidden_size=16, num_attention_heads=2, attention_head_size=6,
                  attn_layers=["local", "lsh", "local", "lsh"], feed_forward_size=32, axial_pos_shape=(4, 8),
                  axial_pos_embds_dim=(6, 10), max_position_embeddings=32, is_decoder=True, lsh_attn_chunk_length=32,
                  local_attn_chunk_length=4, num_buckets=4, num_hashes=2, hidden_dropout_prob=0.0,
                  local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0, pad_token_id=0)
    values.update(overrides)
    torch.manual_seed(0)
    model = ReformerModelWithLMHead(ReformerConfig(**values)).double().eval()
    with torch.no_grad():  # every weight random, so a swapped or transposed tensor cannot go unnoticed
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("overrides", [
    dict(),  # local layers chunked (chunks of 4), LSH layers on their full-attention path
    dict(attn_layers=["lsh", "lsh"], lsh_attn_chunk_length=16, axial_pos_embds=False, hidden_act="gelu"),
    dict(attn_layers=["local"], local_num_chunks_before=2, chunk_size_feed_forward=1, attention_head_size=8),
])
def test_transformers_reformer_converts_to_equal_logits(overrides, tmp_path):
    from attnzoo.convert.reformer_from_transformers import convert_model, main

    source = transformers_reformer(**overrides)
    model = convert_model(source)
    # transformers 5.24 gave the Reformer's LM head a bias again (5.0-5.23 had none): it converts wherever it exists
    assert model.config.lm_head_bias == (source.lm_head.decoder.bias is not None)
    ids = torch.randint(1, 37, (2, 13))
    with torch.no_grad():
        expected = source(ids).logits
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected, rtol=1e-10, atol=1e-10)
        short = ids[:, :3]  # shorter than every chunk
        torch.testing.assert_close(model(short, use_cache=False).logits, source(short).logits, rtol=1e-10,
                                   atol=1e-10)
    # The command line, from a saved checkpoint. (transformers keeps its axial tables in float32, so its own
    # save/load round trip rounds them: compare with the reloaded source.)
    source.save_pretrained(tmp_path / "src")
    main([str(tmp_path / "src"), str(tmp_path / "dst")])
    loaded = ZooReformerForCausalLM.from_pretrained(tmp_path / "dst", dtype="auto").eval()
    reloaded_source = type(source).from_pretrained(tmp_path / "src", dtype="auto").eval()
    assert loaded.dtype == torch.float64
    assert loaded.config.reversible_merge == "concat" and loaded.config.lsh_attend_to == "chunk"
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reloaded_source(ids).logits, rtol=1e-10, atol=1e-10)
    # cached greedy decoding of the converted model equals its full forward
    generated = loaded.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(loaded(generated[:, :-1]).logits[:, 4:].argmax(-1), generated[:, 5:])


def test_generate_builds_our_cache_despite_reformer_in_the_class_name():
    # transformers' generate() special-cases class names containing "reformer" only in
    # _supports_default_dynamic_cache (generation/utils.py), which ZooPreTrainedModel already answers False: the
    # model builds its own ZooCache of LSH/local layers.
    from attnzoo import ZooCache
    from attnzoo.modeling.cache import TokenBufferLayer

    assert not ZooReformerForCausalLM._supports_default_dynamic_cache()
    model = TestReformerFamily().build("ForCausalLM").eval()
    out = model.generate(torch.randint(2, 50, (1, 6)), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    cache = output_cache(out)
    assert isinstance(cache, ZooCache) and cache.get_seq_length() == 8
    assert [type(layer) for layer in cache.layers] == [TokenBufferLayer, TokenBufferLayer]


@pytest.mark.parametrize("head", ["ForCausalLM", "ForMaskedLM", "ForSequenceClassification",
                                  "ForImageClassification", "ForConditionalGeneration"])
def test_concatenated_streams_work_with_every_head_and_the_reversible_backward(head):
    # reversible_merge="concat" (transformers' Reformer layout): heads read 2 * hidden_size features; the reversible
    # backward splits the incoming gradient between the streams instead of halving it.
    suite = TestReformerFamily()
    torch.manual_seed(0)
    config = suite.make_config(reversible_merge="concat", tie_word_embeddings=False, hidden_dropout_prob=0.1)
    model = suite.model_class(head)(config).double().train()
    inputs = suite.inputs_for(head)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].double()
    labels = suite.labels_for(head, inputs, config)
    results = []
    for use_reversible_backward in (True, False):
        for module in model.modules():
            if hasattr(module, "use_reversible_backward"):
                module.use_reversible_backward = use_reversible_backward
        model.zero_grad()
        torch.manual_seed(5)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-12)
    assert results[0][1].keys() == results[1][1].keys()
    for name in results[1][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-7, atol=1e-10, msg=named(name))


# -- causality and padding of whole models ---------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", [["lsh"], ["local"], ["local", "lsh"]])
def test_causal_models_leak_nothing_from_the_future_with_real_hashing(pattern):
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(attn_layers=pattern, lsh_num_buckets=None)).double().eval()
    ids = torch.randint(2, 37, (2, 23))
    base = model(ids).logits
    for t in (5, 12, 22):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 5) % 35 + 2
        logits = model(changed).logits
        torch.testing.assert_close(logits[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(logits[:, t:], base[:, t:])


def test_chunk_window_lets_later_hashes_move_earlier_windows():
    # Documents why "bucket" is the default: with chunk windows a later token can reorder the sorted sequence and
    # change which earlier keys share an earlier query's chunk.
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(attn_layers=["lsh"], lsh_attend_to="chunk", num_hidden_layers=1,
                                             lsh_num_buckets=8)).double().eval()
    ids = torch.randint(2, 37, (1, 32))
    base = model(ids).logits
    moved = False
    for t in range(16, 32):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 5) % 35 + 2
        moved |= not torch.allclose(model(changed).logits[:, :16], base[:, :16], rtol=0, atol=1e-12)
    assert moved


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["lsh", "local"])
def test_padded_rows_equal_the_sequence_alone(kind, causal):
    torch.manual_seed(1)
    cls = LSHAttention if kind == "lsh" else LocalAttention
    attn = cls(config(lsh_hash_seed=11, lsh_num_hashes=2), 0, causal).double().eval()
    seq = torch.randn(1, 10, HIDDEN, dtype=torch.float64)
    alone = attn(seq)
    for side in ("left", "right"):
        filler = torch.randn(1, 5, HIDDEN, dtype=torch.float64)
        x = torch.cat([filler, seq] if side == "left" else [seq, filler], dim=1)
        mask = torch.ones(1, 15, dtype=torch.bool)
        mask[0, :5] = side != "left"
        mask[0, 10:] = side != "right"
        # Row 0 of any batch gets the same seeded rotations, so the padded row hashes like the sequence alone.
        got = attn(x, attention_mask=mask)[mask]
        torch.testing.assert_close(got, alone[0], rtol=1e-10, atol=1e-12, msg=side)


def test_any_length_trains_and_generates():
    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(lsh_hash_seed=None, lsh_num_buckets=None, reversible=True,
                                             position_embedding_type="axial")).train()
    for length in (5, 13, 30):
        ids = torch.randint(2, 37, (2, length))
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    out = model.eval().generate(torch.randint(2, 37, (2, 7)), max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)


# -- configuration -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("lsh_chunk_length", 0), ("lsh_num_buckets", 5), ("lsh_num_buckets", [4, 3]),
                                         ("lsh_num_hashes", 0), ("lsh_num_hashes_eval", 0), ("lsh_attend_to", "ring"),
                                         ("lsh_hash_seed", -1), ("lsh_full_attention_threshold", -2),
                                         ("lsh_num_chunks_before", -1), ("local_chunk_length", 0),
                                         ("local_num_chunks_after", -1), ("lsh_attention_probs_dropout_prob", 1.0),
                                         ("attention_head_size", 0), ("reversible_merge", "sum"),
                                         ("lsh_duplicate_correction", "no")])
def test_bad_reformer_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        config(**{field: value})


def test_lsh_defaults_follow_the_paper():
    """Section 2 of arXiv 2001.04451: a bidirectional LSH query attends within its own chunk and the one before it
    (none ahead), and the rounds' duplicated keys are corrected for; local attention looks one chunk each way."""
    cfg = config()
    assert (cfg.lsh_num_chunks_before, cfg.lsh_num_chunks_after) == (1, 0)
    assert (cfg.local_num_chunks_before, cfg.local_num_chunks_after) == (1, 1)
    assert cfg.lsh_duplicate_correction is True and cfg.lsh_attend_to == "bucket"


def test_concatenated_streams_need_reversible_and_untied_embeddings():
    with pytest.raises(ValueError, match="reversible_merge"):
        config(reversible=False, reversible_merge="concat", tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        config(reversible_merge="concat")
    assert config(reversible_merge="concat", tie_word_embeddings=False).stack_output_size == 2 * HIDDEN


def test_a_config_saved_with_the_older_lsh_window_key_loads_with_the_same_behaviour(tmp_path):
    """`lsh_window` ("bucket"/"chunk") is now `lsh_attend_to`, so that "window" means only the sliding window with
    sinks; a checkpoint saved with the older key attends as it did."""
    import json

    torch.manual_seed(0)
    model = ZooReformerForCausalLM(lm_config(attn_layers=["lsh"], lsh_attend_to="chunk", num_hidden_layers=1)).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "lsh_window" not in saved
    saved["lsh_window"] = saved.pop("lsh_attend_to")  # as an earlier release wrote it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = ZooReformerForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.lsh_attend_to == "chunk" and loaded.model.transformer.blocks[0].attn.attend_to == "chunk"
    ids = torch.randint(1, 37, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"lsh_window='bucket' and lsh_attend_to='chunk' set the same thing"):
        ZooReformerConfig(lsh_attend_to="chunk", lsh_window="bucket")
