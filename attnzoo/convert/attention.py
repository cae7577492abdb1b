"""Change the attention of an attnzoo checkpoint: the same backbone and weights, another family or attention layout.

    python -m attnzoo.convert.attention SRC DST --family hybrid \
        --model attn_layers=[window,window,window,lsh_window] window_size=32 num_sink_tokens=4 \
                far_positions=[rotary,rotary,rotary,none] far_query_scale=log far_query_scale_length=256

SRC is an attnzoo checkpoint (a folder or a Hub id) of any family and head; DST receives the model with the same
head in `--family` (`ZooHybridForCausalLM` from a `ZooSoftmaxForCausalLM`, ...) and SRC's tokenizer. Every family
shares one backbone, so everything outside the attention is copied as it is: embeddings, positions, norms,
feed-forward layers, heads. Each attention's projections go where the target attention keeps them (the layouts of
`attnzoo.convert.common`): a layer that becomes shared-QK LSH takes the source's query projection for its shared one
and drops the key projection (reported); a separate-QK target (`lsh_shared_qk=false`, every non-LSH attention) needs
the source's key projection, so a shared-QK source does not convert to it (ValueError). Parameters of the source's
attention that the target also has, with the same shape, are kept (a learned FAVOR+ projection converted to
another FAVOR+ layout); the others are reported as dropped, and the target's own start from their initialisation.

The settings that fix the function of the backbone (sizes, norms, activations, biases, positions, residual kind,
token ids) are the source's and cannot be overridden. Dropout, `max_position_embeddings` and every attention setting
can: `far_positions` and `far_query_scale` are how a rotary model is made ready for contexts beyond its training
length (docs/long_context.md), followed by fine-tuning with `scripts/train_lm.py --model_name_or_path DST`.
Settings of the source's own family carry over when `--family` is that family, and are left behind otherwise.
"""

from __future__ import annotations

import copy

import torch

from attnzoo.configuration.base import ZooConfig
from attnzoo.convert.common import (
    ConversionReport,
    attention_weights,
    build_config,
    find_projection_layout,
    init_attention_extras,
    load_converted,
    seeded,
    text_converter_main,
)

#: ZooConfig fields that say how attention works, not what the backbone computes: the user's to set
ATTENTION_FIELDS = ("attn_layers", "decoder_attn_layers", "far_positions", "far_query_scale",
                    "far_query_scale_length")
#: backbone fields that do not change the trained function (regularisation, table sizes, memory chunking, start):
#: the source's values are the defaults, which `--model` may change
ADJUSTABLE_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate", "classifier_dropout",
                     "max_position_embeddings", "loss_chunk_size", "initializer_range")
#: transformers' own config keys that travel with the model
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "tie_word_embeddings")


def check_source_config(config) -> None:
    model_type = getattr(config, "model_type", "")
    if not isinstance(config, ZooConfig):
        raise ValueError(f"model_type={model_type!r} is not an attnzoo checkpoint; convert a transformers one with "
                         "attnzoo.convert.llama (Llama, Qwen2, Mistral), attnzoo.convert.gpt2 or attnzoo.convert.vit.")


def source_head(source) -> str:
    """The head of an attnzoo model ("ForCausalLM", "Model", ...), as its class name spells it."""
    from attnzoo.registration import AUTO_CLASS_BY_HEAD

    prefix = type(source.config).__name__.removesuffix("Config")
    head = type(source).__name__.removeprefix(prefix)
    if head not in AUTO_CLASS_BY_HEAD:
        raise ValueError(f"{type(source).__name__} is not one of the {prefix} classes ({sorted(AUTO_CLASS_BY_HEAD)}); "
                         "load the source with the Auto class of its head.")
    return head


def target_config(source_config, family: str, overrides: dict | None = None):
    """The config of `family` whose backbone is `source_config`'s (see the module docstring for what may change)."""
    from attnzoo.convert.common import family_config_class

    check_source_config(source_config)
    target_class = family_config_class(family)
    backbone = [name for name in ZooConfig.__dataclass_fields__ if name not in ATTENTION_FIELDS]
    fixed = {name: getattr(source_config, name) for name in backbone if name not in ADJUSTABLE_FIELDS}
    fixed.update({name: getattr(source_config, name) for name in TOKEN_FIELDS if hasattr(source_config, name)})
    if "attention_head_size" in target_class.__dataclass_fields__:  # LSH and local heads as wide as the source's
        fixed["attention_head_size"] = getattr(source_config, "attention_head_size", None)
    defaults = {name: getattr(source_config, name) for name in ADJUSTABLE_FIELDS}
    if type(source_config) is target_class:  # the family's own settings carry over, attention layouts included
        own = set(target_class.__dataclass_fields__) - set(backbone)
        defaults.update({name: copy.deepcopy(getattr(source_config, name)) for name in own})
    return build_config(family, fixed, defaults, overrides)


def convert_state_dict(source, model, report: ConversionReport) -> dict[str, torch.Tensor]:
    """The tensors of `model` from `source` (both attnzoo models with the same backbone): attention projections
    by role, every other tensor by name."""
    source_state = source.state_dict()
    target_state = model.state_dict()
    targets = dict(model.named_modules())
    out, used = {}, set()
    for name, attn in source.named_modules():
        layout = find_projection_layout(attn)
        if layout is None:
            continue
        target = targets.get(name)
        if target is None or find_projection_layout(target) is None:
            raise ValueError(f"the source's attention {name} has no attention at the same place in "
                             f"{type(model).__name__}; the two models' layers differ.")
        roles = {role: getattr(attn, module) for module, role in layout.items()}
        missing = [role for role in find_projection_layout(target).values() if role not in roles]
        if missing:
            raise ValueError(f"{name} of the source shares one query-key projection (shared-QK LSH); the target's "
                             f"{getattr(target, 'name', type(target).__name__)!r} attention needs a separate key "
                             "projection, which the source does not have. Convert with lsh_shared_qk=true or pick "
                             "LSH kinds for these layers.")
        projections = {role: (linear.weight, linear.bias) for role, linear in roles.items()}
        names = {role: f"{name}.{module}" for module, role in layout.items()}
        out.update(attention_weights(target, f"{name}.", projections, report, names))
        used.update(f"{name}.{module}.{part}" for module in layout for part in ("weight", "bias"))
    for key, tensor in source_state.items():
        if key in used or key in out:
            continue
        if key in target_state and target_state[key].shape == tensor.shape:
            out[key] = tensor
        elif ".attn." in key:  # the source attention's own parameters (landmark transforms, learned features)
            report.dropped.append(key)
        else:
            raise ValueError(f"the source's {key} {tuple(tensor.shape)} has no place in {type(model).__name__} "
                             f"({'shape ' + str(tuple(target_state[key].shape)) if key in target_state else 'none'})"
                             "; the backbones differ.")
    return out


def convert(source, family: str = "softmax", overrides: dict | None = None, seed: int = 0, report=None):
    """An attnzoo model of `family` with `source`'s head and weights, in its dtype and training mode."""
    from attnzoo.registration import AUTO_CLASS_BY_HEAD

    head = source_head(source)
    report = report if report is not None else ConversionReport()
    config = target_config(source.config, family, overrides)
    with seeded(seed):
        model = AUTO_CLASS_BY_HEAD[head].from_config(config, dtype=next(source.parameters()).dtype)
    init_attention_extras(model)
    load_converted(model, convert_state_dict(source, model, report), report)
    if getattr(source, "generation_config", None) is not None and hasattr(model, "generation_config"):
        model.generation_config = copy.deepcopy(source.generation_config)
    return model.train(source.training)


def load_source(src: str):
    """The attnzoo model SRC holds, with the head its config names, in eval mode."""
    from transformers import AutoConfig

    from attnzoo.registration import AUTO_CLASS_BY_HEAD
    from attnzoo.training.model_source import reading_model_source

    with reading_model_source(src, "SRC"):
        config = AutoConfig.from_pretrained(src)
    check_source_config(config)
    prefix = type(config).__name__.removesuffix("Config")
    heads = [a.removeprefix(prefix) for a in (config.architectures or [f"{prefix}Model"])]
    heads = [head for head in heads if head in AUTO_CLASS_BY_HEAD]
    if not heads:
        raise ValueError(f"{src} names the architectures {config.architectures}, none of them a {prefix} class.")
    return AUTO_CLASS_BY_HEAD[heads[0]].from_pretrained(src, dtype="auto").eval()


def main(argv=None) -> None:
    text_converter_main(__doc__, "python -m attnzoo.convert.attention", "an attnzoo checkpoint: a folder or a Hub id",
                        load_source, convert, argv)


if __name__ == "__main__":
    main()
