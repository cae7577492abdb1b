"""Convert a transformers `ReformerModelWithLMHead` (weights and `ReformerConfig`) into `ZooReformerForCausalLM`.

    python -m attnzoo.convert.reformer_from_transformers SRC DST

SRC is a folder (or anything `ReformerModelWithLMHead.from_pretrained` accepts); DST receives the attnzoo model
(`save_pretrained`) and, when SRC has one, the tokenizer.

What makes the two compute the same function:
- transformers' Reformer ends with a LayerNorm over both reversible streams side by side and an LM head on those
  2 * hidden_size features, so the converted config sets `reversible_merge="concat"` (and untied embeddings);
- no biases in the attention projections (`attention_bias=False`), its LayerNorm eps, activation and sizes, an
  attention head size that may differ from hidden_size / heads;
- LSH: shared query-key projection, keys normalised the same way (RMS-norm / sqrt(d)), the self-penalty -1e5 and
  mask value -1e9, full attention up to `lsh_attn_chunk_length` tokens, chunk windows across buckets
  (`lsh_attend_to="chunk"`) and no duplicate correction (transformers has none);
- local attention: separate Q/K/V, 1/sqrt(d) scaling, the same chunk grid and look-back;
- axial position embeddings: transformers keeps axis i as a [1, .., n_i, .., 1, d_i] tensor broadcast over the
  row-major grid, which is our `weight_i` [n_i, d_i] with the same row-major digits.
The logits are then equal for every causal model whose LSH layers see at most `lsh_attn_chunk_length` tokens
(the full-attention path) and for local layers at any length. With hashing they cannot be equal, by construction:
transformers draws one rotation per head for the whole batch from the global RNG and lets the first chunk of each
round look back at the last chunk of the previous round (wrapping around); we draw per (example, head) and do not
wrap (Reformer, arXiv 2001.04451, §2).

Dropout sits in slightly different places (transformers also drops inside the feed-forward, on the word embeddings
before the positions are added and after the final LayerNorm), which matters only when fine-tuning with dropout.

The LM head's bias: transformers v4 tied `lm_head.bias` to the decoder's bias; 5.0-5.23 dropped the decoder's bias,
so `lm_head.bias` was never added (a regression); 5.24 gives the decoder its own bias again (`lm_head.decoder.bias`,
which v4 checkpoints hold too) and leaves `lm_head.bias` unused. The converter follows whichever transformers is
installed: it carries the decoder's bias when the source model has one (`lm_head_bias=True`) and warns when the
unused `lm_head.bias` is not zero.
"""

from __future__ import annotations

import argparse
import logging
import math

import torch

from attnzoo.configuration.base import HIDDEN_ACTIVATIONS
from attnzoo.configuration.reformer import ZooReformerConfig
from attnzoo.modeling.modeling_reformer import ZooReformerForCausalLM

logger = logging.getLogger(__name__)


def convert_config(hf_config, lm_head_bias: bool = False) -> ZooReformerConfig:
    """The `ZooReformerConfig` that computes what `hf_config`'s `ReformerModelWithLMHead` computes; `lm_head_bias`
    says whether its LM head adds a bias (module docstring)."""
    if not hf_config.is_decoder:
        raise ValueError("the source config has is_decoder=False; only causal ReformerModelWithLMHead checkpoints "
                         "convert (set is_decoder=True on a language model).")
    if not isinstance(hf_config.hidden_act, str) or hf_config.hidden_act not in HIDDEN_ACTIVATIONS:
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} has no attnzoo equivalent; supported: "
                         f"{HIDDEN_ACTIVATIONS}.")
    attn_layers = list(hf_config.attn_layers)
    values = dict(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size, num_hidden_layers=len(attn_layers),
        num_attention_heads=hf_config.num_attention_heads, attention_head_size=hf_config.attention_head_size,
        intermediate_size=hf_config.feed_forward_size, hidden_act=hf_config.hidden_act,
        max_position_embeddings=hf_config.max_position_embeddings, layer_norm_eps=hf_config.layer_norm_eps,
        initializer_range=hf_config.initializer_range, hidden_dropout_prob=hf_config.hidden_dropout_prob,
        attention_probs_dropout_prob=0.0, attention_bias=False, lm_head_bias=lm_head_bias, attn_layers=attn_layers,
        is_decoder=True,
        reversible=True, reversible_merge="concat", tie_word_embeddings=False,
        chunk_size_feed_forward=hf_config.chunk_size_feed_forward or 0,
        lsh_chunk_length=hf_config.lsh_attn_chunk_length, lsh_num_chunks_before=hf_config.lsh_num_chunks_before,
        lsh_num_chunks_after=hf_config.lsh_num_chunks_after, lsh_num_hashes=hf_config.num_hashes,
        lsh_num_buckets=hf_config.num_buckets if hf_config.num_buckets is None or isinstance(
            hf_config.num_buckets, int) else list(hf_config.num_buckets),
        lsh_hash_seed=hf_config.hash_seed, lsh_full_attention_threshold=hf_config.lsh_attn_chunk_length,
        lsh_attend_to="chunk", lsh_duplicate_correction=False,
        lsh_attention_probs_dropout_prob=hf_config.lsh_attention_probs_dropout_prob,
        local_chunk_length=hf_config.local_attn_chunk_length,
        local_num_chunks_before=hf_config.local_num_chunks_before,
        local_num_chunks_after=hf_config.local_num_chunks_after,
        local_attention_probs_dropout_prob=hf_config.local_attention_probs_dropout_prob,
        pad_token_id=hf_config.pad_token_id, eos_token_id=hf_config.eos_token_id,
        bos_token_id=hf_config.bos_token_id, use_cache=hf_config.use_cache,
    )
    if hf_config.axial_pos_embds:
        shape = list(hf_config.axial_pos_shape)
        values.update(position_embedding_type="axial", axial_pos_shape=shape,
                      axial_pos_embds_dim=list(hf_config.axial_pos_embds_dim),
                      # transformers does not require the axial grid to cover max_position_embeddings; we do
                      max_position_embeddings=min(hf_config.max_position_embeddings, math.prod(shape)))
    else:
        values.update(position_embedding_type="learned")
    return ZooReformerConfig(**values)


def convert_state_dict(hf_state: dict[str, torch.Tensor], hf_config, config: ZooReformerConfig) -> dict:
    """Rename (and reshape the axial tables of) a `ReformerModelWithLMHead` state dict."""
    out = {"model.embed_tokens.weight": hf_state["reformer.embeddings.word_embeddings.weight"]}
    if hf_config.axial_pos_embds:
        for axis, size in enumerate(config.axial_pos_shape):
            weight = hf_state[f"reformer.embeddings.position_embeddings.weights.{axis}"]
            out[f"model.transformer.positions.table.weight_{axis}"] = weight.reshape(size, weight.shape[-1])
    else:
        table = hf_state["reformer.embeddings.position_embeddings.embedding.weight"]
        out["model.transformer.positions.table.weight"] = table[:config.max_position_embeddings]
    attention_names = {"lsh": {"query_key": "query_key", "value": "value"},
                       "local": {"query": "query", "key": "key", "value": "value"}}
    for i, kind in enumerate(config.attn_layers):
        src, dst = f"reformer.encoder.layers.{i}.", f"model.transformer.blocks.{i}."
        out[dst + "attn_norm.weight"] = hf_state[src + "attention.layer_norm.weight"]
        out[dst + "attn_norm.bias"] = hf_state[src + "attention.layer_norm.bias"]
        for hf_name, name in attention_names[kind].items():
            out[dst + f"attn.{name}.weight"] = hf_state[src + f"attention.self_attention.{hf_name}.weight"]
        out[dst + "attn.output.weight"] = hf_state[src + "attention.output.dense.weight"]
        out[dst + "ffn_norm.weight"] = hf_state[src + "feed_forward.layer_norm.weight"]
        out[dst + "ffn_norm.bias"] = hf_state[src + "feed_forward.layer_norm.bias"]
        for hf_name, name in (("dense.dense", "fc_in"), ("output.dense", "fc_out")):
            out[dst + f"ffn.{name}.weight"] = hf_state[src + f"feed_forward.{hf_name}.weight"]
            out[dst + f"ffn.{name}.bias"] = hf_state[src + f"feed_forward.{hf_name}.bias"]
    out["model.transformer.final_norm.weight"] = hf_state["reformer.encoder.layer_norm.weight"]
    out["model.transformer.final_norm.bias"] = hf_state["reformer.encoder.layer_norm.bias"]
    out["lm_head.weight"] = hf_state["lm_head.decoder.weight"]
    if config.lm_head_bias:
        out["lm_head.bias"] = hf_state["lm_head.decoder.bias"]
    unused = hf_state.get("lm_head.bias")
    if unused is not None and unused.abs().max() > 0:
        logger.warning("lm_head.bias is not zero, but transformers' Reformer never adds it (only its decoder's own "
                       "bias, where it has one); the converted model leaves it out as well, so both give the same "
                       "logits.")
    return out


def convert_model(hf_model) -> ZooReformerForCausalLM:
    """A `ZooReformerForCausalLM` with `hf_model`'s weights, in `hf_model`'s dtype."""
    config = convert_config(hf_model.config, lm_head_bias=hf_model.lm_head.decoder.bias is not None)
    dtype = next(hf_model.parameters()).dtype
    model = ZooReformerForCausalLM(config).to(dtype)
    state = convert_state_dict(hf_model.state_dict(), hf_model.config, config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    return model.train(hf_model.training)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="transformers ReformerModelWithLMHead checkpoint (folder or hub name)")
    parser.add_argument("dst", help="output folder for the ZooReformerForCausalLM (must not exist or be empty)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer, ReformerModelWithLMHead

    from attnzoo.convert.common import check_destination, save_converted
    from attnzoo.training.model_source import reading_model_source

    check_destination(args.dst)  # before loading anything: a folder of someone else's files is never written into
    with reading_model_source(args.src, "SRC"):
        source = ReformerModelWithLMHead.from_pretrained(args.src, dtype="auto").eval()
    model = convert_model(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.src)
    except (OSError, ValueError, ImportError) as error:  # no tokenizer next to the weights, or one we cannot load
        logger.warning("tokenizer not copied: %s", error)
        tokenizer = None
    save_converted(model, args.dst, [tokenizer], converter="attnzoo.convert.reformer_from_transformers",
                   src=args.src, family="reformer")
    print(f"wrote {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters) to {args.dst}")


if __name__ == "__main__":
    main()
