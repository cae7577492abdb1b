"""Convert a transformers GPT-2 checkpoint (`GPT2LMHeadModel` or `GPT2Model`) into any attnzoo family.

    python -m attnzoo.convert.gpt2 SRC DST --family performer [--model num_random_features=128 ...]

SRC is a folder or a Hub id; DST receives the attnzoo model (`ZooXForCausalLM` for a `GPT2LMHeadModel`, the base
decoder `ZooXModel` for a `GPT2Model`) and SRC's tokenizer, so it loads with `AutoModelForCausalLM` /
`AutoTokenizer` and fine-tunes with `scripts/train_lm.py --model_name_or_path DST`.

GPT-2 is the zoo's backbone: pre-LayerNorm blocks, learned absolute positions, a final LayerNorm, an LM head tied to
the token embedding, biases on every projection, the tanh GELU ("gelu_new"). With `--family softmax` the converted
model computes the same logits (float64: to 1e-10). Other families get every shared weight (embeddings, norms,
feed-forward, the attention's q/k/v/output projections; see `attnzoo.convert.common` for each attention's layout)
and their attention settings from `--model`; their attention then approximates the source's
(`benchmarks/conversion_fidelity.py` measures how closely) and is fine-tuned from there, as "Finetuning Pretrained
Transformers into RNNs" (arXiv 2103.13076) does for linear attention.

Reformer conversions keep the family's layer pattern, alternating local and LSH attention (as trax's enwik8 config):
local layers take q/k/v as they are and equal the source's attention for queries whose keys all lie in their
window; LSH layers share one query-key projection, which starts as the source's query projection (the key
projection is dropped), so they change the attention more. `--model attn_layers=[lsh]` makes every layer LSH,
`attn_layers=[local]` every layer local. Whatever the family, the residual stack stays standard (not reversible)
and positions stay the learned table: those must match the source.

Not converted (ValueError naming the option): `scale_attn_weights=False`, `scale_attn_by_inverse_layer_idx=True`,
`add_cross_attention=True`, an activation the zoo does not have, other architectures (e.g. BERT's post-LayerNorm
blocks), and any weight the mapping does not know. Left-padded batches: GPT-2 numbers positions from the start of the
padded row, the zoo from the first real token (so a padded sequence matches the unpadded one); without padding both
agree.
"""

from __future__ import annotations

import logging

import torch

from attnzoo.configuration.base import HIDDEN_ACTIVATIONS
from attnzoo.convert.common import (
    ConversionReport,
    attention_weights,
    build_config,
    init_attention_extras,
    load_converted,
    load_text_tokenizer,
    seeded,
    text_converter_main,
)

logger = logging.getLogger(__name__)

ARCHITECTURES = {"GPT2LMHeadModel": "causal_lm", "GPT2Model": "base"}
#: model types whose blocks normalise after the residual addition (post-LayerNorm): the zoo's are pre-LayerNorm
POST_LAYER_NORM_TYPES = ("bert", "roberta", "distilbert", "albert", "electra", "xlm-roberta", "openai-gpt", "camembert")
#: buffers older GPT-2 checkpoints carry (the causal mask); the zoo's attention masks by itself
MASK_BUFFERS = ("attn.bias", "attn.masked_bias")


def check_source_config(config) -> None:
    """ValueError naming every option of a GPT-2 config that has no attnzoo equivalent."""
    model_type = getattr(config, "model_type", None)
    if model_type != "gpt2":
        why = ("its blocks are post-LayerNorm (the residual sum is normalised), the zoo's backbone is pre-LayerNorm"
               if model_type in POST_LAYER_NORM_TYPES else "this converter reads GPT-2 checkpoints only")
        raise ValueError(f"model_type={model_type!r} does not map to the attnzoo backbone: {why}.")
    problems = []
    if not config.scale_attn_weights:
        problems.append("scale_attn_weights=False (the zoo always scales attention scores by 1/sqrt(head_dim))")
    if config.scale_attn_by_inverse_layer_idx:
        problems.append("scale_attn_by_inverse_layer_idx=True (no per-layer score scaling in the zoo)")
    if config.add_cross_attention:
        problems.append("add_cross_attention=True (decoder-only models convert; cross-attention has no place)")
    if config.activation_function not in HIDDEN_ACTIVATIONS:
        problems.append(f"activation_function={config.activation_function!r} (the zoo has {HIDDEN_ACTIVATIONS})")
    if problems:
        raise ValueError("this GPT-2 checkpoint does not map to the attnzoo backbone: " + "; ".join(problems) + ".")


def target_config(source_config, family: str, overrides: dict | None = None):
    """The attnzoo config of `family` whose backbone computes what `source_config`'s GPT-2 computes."""
    check_source_config(source_config)
    hidden = source_config.n_embd
    fixed = dict(vocab_size=source_config.vocab_size, hidden_size=hidden, num_hidden_layers=source_config.n_layer,
                 num_attention_heads=source_config.n_head,
                 intermediate_size=source_config.n_inner or 4 * hidden,
                 hidden_act=source_config.activation_function, max_position_embeddings=source_config.n_positions,
                 layer_norm_eps=source_config.layer_norm_epsilon, attention_bias=True,
                 position_embedding_type="learned", reversible=False, is_decoder=True,
                 tie_word_embeddings=source_config.tie_word_embeddings)
    if family == "reformer":
        fixed["attention_head_size"] = None
    defaults = dict(hidden_dropout_prob=source_config.resid_pdrop,
                    attention_probs_dropout_prob=source_config.attn_pdrop,
                    initializer_range=source_config.initializer_range, bos_token_id=source_config.bos_token_id,
                    eos_token_id=source_config.eos_token_id, pad_token_id=source_config.pad_token_id,
                    use_cache=source_config.use_cache)
    if source_config.embd_pdrop != source_config.resid_pdrop:
        logger.warning("embd_pdrop=%s differs from resid_pdrop=%s; the zoo uses hidden_dropout_prob=%s for both "
                       "(it matters only when fine-tuning with dropout).", source_config.embd_pdrop,
                       source_config.resid_pdrop, source_config.resid_pdrop)
    return build_config(family, fixed, defaults, overrides)


def source_kind(model) -> str:
    """"causal_lm" or "base" for a GPT2LMHeadModel / GPT2Model; ValueError for anything else."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        check_source_config(model.config)  # a non-GPT-2 model: name what does not map
        raise ValueError(f"{name} does not map: convert a GPT2LMHeadModel (-> ForCausalLM) or a GPT2Model "
                         "(-> the base decoder).")
    return ARCHITECTURES[name]


def convert_state_dict(state: dict[str, torch.Tensor], source_config, model, kind: str,
                       report: ConversionReport) -> dict[str, torch.Tensor]:
    """The attnzoo tensors of `model` from a GPT-2 state dict; ValueError naming any source key left unmapped."""
    remaining = dict(state)
    src_prefix = "transformer." if kind == "causal_lm" else ""
    dst_prefix = "model." if kind == "causal_lm" else ""

    def take(name: str) -> torch.Tensor:
        key = src_prefix + name
        if key not in remaining:
            raise ValueError(f"the source has no {key!r}; it is not a complete GPT-2 checkpoint.")
        return remaining.pop(key)

    def conv1d(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """GPT-2's Conv1D keeps weights as [in, out]; nn.Linear wants [out, in]."""
        return take(f"{name}.weight").t(), take(f"{name}.bias")

    hidden = source_config.n_embd
    out = {f"{dst_prefix}embed_tokens.weight": take("wte.weight"),
           f"{dst_prefix}transformer.positions.table.weight": take("wpe.weight")}
    base = model.model if kind == "causal_lm" else model
    for i, block in enumerate(base.transformer.blocks):
        src, dst = f"h.{i}.", f"{dst_prefix}transformer.blocks.{i}."
        out[dst + "attn_norm.weight"], out[dst + "attn_norm.bias"] = take(src + "ln_1.weight"), take(src + "ln_1.bias")
        qkv_weight, qkv_bias = conv1d(src + "attn.c_attn")
        weights, biases = qkv_weight.split(hidden, dim=0), qkv_bias.split(hidden)
        projections = {role: (weights[j], biases[j]) for j, role in enumerate("qkv")}
        projections["o"] = conv1d(src + "attn.c_proj")
        names = {role: f"{src_prefix}{src}attn.c_attn ({role} part)" for role in "qkv"}
        out.update(attention_weights(block.attn, dst + "attn.", projections, report, names))
        out[dst + "ffn_norm.weight"], out[dst + "ffn_norm.bias"] = take(src + "ln_2.weight"), take(src + "ln_2.bias")
        out[dst + "ffn.fc_in.weight"], out[dst + "ffn.fc_in.bias"] = conv1d(src + "mlp.c_fc")
        out[dst + "ffn.fc_out.weight"], out[dst + "ffn.fc_out.bias"] = conv1d(src + "mlp.c_proj")
        for buffer in MASK_BUFFERS:
            remaining.pop(f"{src_prefix}{src}{buffer}", None)
    out[f"{dst_prefix}transformer.final_norm.weight"] = take("ln_f.weight")
    out[f"{dst_prefix}transformer.final_norm.bias"] = take("ln_f.bias")
    if kind == "causal_lm":
        out["lm_head.weight"] = remaining.pop("lm_head.weight", out["model.embed_tokens.weight"])
    if remaining:
        raise ValueError(f"source weights the GPT-2 mapping does not know: {sorted(remaining)[:5]}; nothing was "
                         "converted.")
    return out


def convert(source, family: str = "softmax", overrides: dict | None = None, seed: int = 0, report=None):
    """An attnzoo model of `family` with the weights of `source` (a GPT2LMHeadModel or GPT2Model), in the source's
    dtype and training mode. `overrides`: attention settings of the family's config (e.g. num_random_features)."""
    from transformers import AutoModel, AutoModelForCausalLM

    kind = source_kind(source)
    report = report if report is not None else ConversionReport()
    config = target_config(source.config, family, overrides)
    if kind == "causal_lm" and config.tie_word_embeddings:
        lm_head, embedding = source.lm_head.weight, source.transformer.wte.weight
        if lm_head.data_ptr() != embedding.data_ptr() and not torch.equal(lm_head, embedding):
            raise ValueError("the source says tie_word_embeddings=True but lm_head.weight differs from "
                             "transformer.wte.weight; fix its config (tie_word_embeddings=False).")
    auto_class = AutoModelForCausalLM if kind == "causal_lm" else AutoModel
    with seeded(seed):
        model = auto_class.from_config(config)
    model.to(next(source.parameters()).dtype)
    init_attention_extras(model)
    state = convert_state_dict(source.state_dict(), source.config, model, kind, report)
    load_converted(model, state, report)
    return model.train(source.training)


def load_source(src: str):
    """A GPT2LMHeadModel or GPT2Model from a folder or Hub id (the class its config names), in eval mode."""
    from transformers import AutoConfig, GPT2LMHeadModel, GPT2Model

    from attnzoo.training.model_source import reading_model_source

    with reading_model_source(src, "SRC"):
        config = AutoConfig.from_pretrained(src)
    check_source_config(config)
    names = [a for a in (config.architectures or ["GPT2LMHeadModel"]) if a in ARCHITECTURES]
    if not names:
        raise ValueError(f"{src} is a {config.architectures} checkpoint; only {sorted(ARCHITECTURES)} convert.")
    model_class = GPT2LMHeadModel if ARCHITECTURES[names[0]] == "causal_lm" else GPT2Model
    model, info = model_class.from_pretrained(src, dtype="auto", output_loading_info=True)
    # from_pretrained skips weights it does not know and initialises ones it does not find; neither may happen here
    unexpected = [k for k in info["unexpected_keys"] if not k.endswith(MASK_BUFFERS)]
    if unexpected:
        raise ValueError(f"{src} holds weights the GPT-2 mapping does not know: {sorted(unexpected)[:5]}; nothing "
                         "was converted.")
    if info["missing_keys"]:
        raise ValueError(f"{src} lacks weights of {model_class.__name__}: {sorted(info['missing_keys'])[:5]}.")
    return model.eval()


def load_tokenizer(src: str):
    return load_text_tokenizer(src)


def main(argv=None) -> None:
    text_converter_main(__doc__, "python -m attnzoo.convert.gpt2",
                        "GPT2LMHeadModel / GPT2Model checkpoint: a folder or a Hub id", load_source, convert, argv)


if __name__ == "__main__":
    main()
