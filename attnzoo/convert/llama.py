"""Convert a transformers Llama-architecture checkpoint (Llama, Qwen2, Mistral) into any attnzoo family.

    python -m attnzoo.convert.llama SRC DST --family performer [--model num_random_features=128 ...]

SRC is a folder, a Hub id or a GGUF checkpoint (see below); DST receives the attnzoo model (`ZooXForCausalLM` for a
`...ForCausalLM`, the base decoder `ZooXModel` for a `...Model`), SRC's tokenizer and generation config, and the
model's own code, so it loads with `AutoModelForCausalLM` / `AutoTokenizer` (where attnzoo is not installed: with
`trust_remote_code=True`) and fine-tunes with `scripts/train_lm.py --model_name_or_path DST`.

GGUF checkpoints (llama.cpp's single-file format; `pip install 'attnzoo[gguf]'`): SRC is a `.gguf` file, or a folder
holding exactly one `.gguf` and no config.json (a folder with several is refused: name the file; a folder with a
config.json is read as a saved model). transformers' own GGUF loader reads it: the config from the file's metadata,
the weights dequantised (a Q4_1 file converts to the Q4_1 model's function, in float32; the original unquantised
weights are not recoverable from it), the tokenizer and chat template from the file's vocabulary, which DST gets as
ordinary tokenizer files (tools that read only saved folders, such as lm-eval, take them). `--family softmax` gives
what `AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME)` computes: the same logits and greedy text. GGUF
files of Llama, Qwen2 and Mistral models convert; refused besides what is listed below: other architectures,
settings transformers' loader does not read (`{arch}.rope.scaling.*`, sliding windows, experts, ...), tensors it
skips (Llama 3.1's `rope_freqs.weight`, its rope scaling) and weights missing from the file. A Hub repository that
holds only GGUF files: download the one to convert first (`hf download REPO FILE.gguf --local-dir DIR`).

Supported sources (`ARCHITECTURES`): `LlamaForCausalLM` / `LlamaModel`, `Qwen2ForCausalLM` / `Qwen2Model` and
`MistralForCausalLM` / `MistralModel`, with these config values:
- any sizes with `head_dim` unset or equal to hidden_size / num_attention_heads, grouped-query attention
  (`num_key_value_heads` dividing `num_attention_heads`: "GQA", arXiv 2305.13245), any `rms_norm_eps`,
  `tie_word_embeddings`, `max_position_embeddings`, `initializer_range`, `attention_dropout`, token ids;
- `hidden_act` among the zoo's activations (`attnzoo.configuration.base.HIDDEN_ACTIVATIONS`; Llama's is "silu");
- biases: Llama's `attention_bias` (q, k, v and output) and `mlp_bias`; Qwen2's q/k/v biases (no output bias);
  Mistral has none;
- rotary positions ("RoFormer", arXiv 2104.09864) with any `rope_theta` and rope type "default", "linear" (position
  interpolation, arXiv 2306.15595) or "llama3", read from `config.rope_parameters` (transformers 5) or from
  `rope_theta` + `rope_scaling` (older releases);
- Llama's `pretraining_tp=1`, Mistral's `sliding_window=None`, Qwen2's `use_sliding_window=False`.

Llama's blocks are the zoo's backbone with `norm_type="rmsnorm"`, `mlp_type="gated"` (SwiGLU, "GLU Variants Improve
Transformer", arXiv 2002.05202) and `position_embedding_type="rotary"`: with `--family softmax` the converted model
computes the same logits (float32: to 1e-5) and generates the same tokens. Other families get every shared weight
(embeddings, norms, the gated feed-forward, the attention's q/k/v/output projections; see `attnzoo.convert.common`
for each attention's layout) and their attention settings from `--model`; their attention then approximates the
source's and is fine-tuned from there, as "Finetuning Pretrained Transformers into RNNs" (arXiv 2103.13076) does for
linear attention. Whatever the family, positions stay rotary, the residual stack standard (not reversible) and the
activation the source's: those must match the source.

Reformer conversions keep the family's layer pattern, alternating local and LSH attention; LSH layers share one
query-key projection, which starts as the source's query projection (the key projection is dropped and reported),
and their values keep the source's `num_key_value_heads` heads. `--model lsh_shared_qk=false` keeps separate
queries and keys instead (every projection carried; the layer attends to its own key and its buckets' recent keys,
docs/lsh_attention.md §7). `--model attn_layers=[lsh]` makes every layer LSH.
`--family hybrid` mixes kinds per layer (default: favor, favor, favor, full repeated; a source of fewer than four
layers keeps its last layer softmax; `--model attn_layers=[local,full]` picks others; a list longer than the source's
depth is refused). The converter prints which layers got which kind.

Not converted (ValueError naming the setting, before anything is written): a sliding window (Mistral's
`sliding_window`, Qwen2's `use_sliding_window=True`), other rope types (dynamic NTK, YaRN, LongRoPE, ...),
`partial_rotary_factor` < 1, a `head_dim` other than hidden_size / num_attention_heads, `pretraining_tp > 1`, an
activation the zoo does not have, qk-norm (Qwen3, OLMo 2: `q_norm` / `k_norm` weights), mixtures of experts (Mixtral,
Qwen2-MoE: `num_local_experts` / `num_experts`), other architectures, and any weight the mapping does not know.
Left-padded batches: the zoo numbers positions from each row's first real token; transformers' Llama uses the
`position_ids` it is given (a forward without them counts from the start of the padded row), so pass it
`attention_mask.cumsum(-1) - 1` (clamped at 0) to compare padded forwards; its `generate()` derives positions from
the mask that way itself, so padded batches decode alike.
"""

from __future__ import annotations

import copy
import logging

import torch

from attnzoo.configuration.base import HIDDEN_ACTIVATIONS
from attnzoo.configuration.rope import ROPE_SCALING_TYPES, rope_scaling_type
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

ARCHITECTURES = {
    "LlamaForCausalLM": "causal_lm", "LlamaModel": "base",
    "Qwen2ForCausalLM": "causal_lm", "Qwen2Model": "base",
    "MistralForCausalLM": "causal_lm", "MistralModel": "base",
}
#: the causal-LM class of each supported model type (a config without `architectures` loads as this)
CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
#: why some well-known relatives do not convert
UNSUPPORTED_MODEL_TYPES = {
    "qwen3": "qk-norm: its attention normalises every query and key head (q_norm / k_norm weights), which no attnzoo "
             "attention has",
    "olmo2": "qk-norm: its attention normalises queries and keys (q_norm / k_norm weights), which no attnzoo "
             "attention has",
    "qwen3_moe": "qk-norm (q_norm / k_norm weights) and a mixture-of-experts feed-forward, neither of which the zoo's "
                 "backbone has",
    "mixtral": "a mixture-of-experts feed-forward (num_local_experts experts and a router per layer); the zoo's "
               "backbone has one feed-forward per layer",
    "qwen2_moe": "a mixture-of-experts feed-forward (num_experts experts and a router per layer); the zoo's backbone "
                 "has one feed-forward per layer",
    "gpt2": "it is a GPT-2; convert it with `python -m attnzoo.convert.gpt2`",
}
#: buffers older checkpoints carry (the rotary table); the zoo computes its own from the config
ROTARY_BUFFERS = ("rotary_emb.inv_freq",)
#: weights of qk-norm (Qwen3, OLMo 2), named in the error when a checkpoint carries them
QK_NORM_WEIGHTS = ("q_norm.weight", "k_norm.weight")
#: rope parameter keys that describe the rotation attnzoo computes (besides the type and theta) per rope type
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def source_rope(config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a source config, in attnzoo's form (`rope_scaling` None for plain RoPE).

    transformers 5 keeps every rotary setting in `config.rope_parameters` (a dict with "rope_type", "rope_theta" and
    the scaling keys); older releases have `config.rope_theta` and `config.rope_scaling` (None or a dict with "type"
    or "rope_type"). Whichever the config has is read (feature detection, not version numbers)."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and parameters:
        nested = [value for value in parameters.values() if isinstance(value, dict)]
        if nested:  # one dict per layer type (models that mix attention kinds): they must all agree
            if any(value != nested[0] for value in nested) or len(nested) != len(parameters):
                raise ValueError(f"rope_parameters={parameters} differ between layer types; attnzoo rotates every "
                                 "layer alike, so only sources with one rope setting for all layers convert.")
            parameters = nested[0]
        theta = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = parameters
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = getattr(config, "rope_scaling", None) or None
    kind = rope_scaling_type(scaling)
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope type {kind!r} (the source's rope_parameters / rope_scaling) does not map: attnzoo "
                         f"supports the rope types {ROPE_SCALING_TYPES} only (dynamic NTK, YaRN and LongRoPE change "
                         "the angles with the length or scale the attention); use a checkpoint trained with one of "
                         "those.")
    partial = (scaling or {}).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} does not map: attnzoo rotates every feature of a head; "
                         "only sources with partial_rotary_factor=1.0 (or unset) convert.")
    attention_factor = (scaling or {}).get("attention_factor")
    if attention_factor not in (None, 1, 1.0):
        raise ValueError(f"rope attention_factor={attention_factor!r} does not map: attnzoo does not scale the "
                         "rotary tables; only sources with attention_factor=1.0 (or unset) convert.")
    if kind == "default":
        return float(theta), None
    values = {key: scaling[key] for key in ROPE_KEYS[kind] if key in scaling}
    if kind == "llama3":  # older configs leave it out; transformers then uses max_position_embeddings
        values.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return float(theta), {"rope_type": kind, **values}


def check_source_config(config) -> None:
    """ValueError naming every option of a Llama / Qwen2 / Mistral config that has no attnzoo equivalent."""
    model_type = getattr(config, "model_type", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if model_type not in CAUSAL_LM_CLASSES:
        if model_type in UNSUPPORTED_MODEL_TYPES:
            why = UNSUPPORTED_MODEL_TYPES[model_type]
        elif experts:
            why = (f"a mixture-of-experts feed-forward ({experts} experts per layer); the zoo's backbone has one "
                   "feed-forward per layer")
        else:
            why = f"this converter reads {sorted(CAUSAL_LM_CLASSES)} checkpoints only"
        raise ValueError(f"model_type={model_type!r} does not map to the attnzoo backbone: {why}.")
    problems = []
    if experts:
        problems.append(f"num_local_experts / num_experts={experts} (a mixture-of-experts feed-forward; the zoo's "
                        "backbone has one feed-forward per layer)")
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        problems.append(f"sliding_window={config.sliding_window} (Mistral's sliding-window attention, which no "
                        "attnzoo attention reproduces: the converted model would attend to every earlier token. "
                        "Convert a checkpoint trained without a window, or set sliding_window to null in its "
                        "config.json if it never sees sequences longer than the window)")
    if getattr(config, "use_sliding_window", False):
        problems.append("use_sliding_window=True (Qwen2's sliding-window layers, which no attnzoo attention "
                        "reproduces: the converted model would attend to every earlier token. Set "
                        "use_sliding_window to false in its config.json if it never sees sequences longer than "
                        "sliding_window)")
    elif any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        problems.append(f"layer_types={config.layer_types} (layers other than full attention; only "
                        "'full_attention' layers convert)")
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim * heads != hidden:
        problems.append(f"head_dim={head_dim} (attnzoo heads are hidden_size / num_attention_heads = "
                        f"{hidden}/{heads} wide; only sources with head_dim unset or equal to that convert)")
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        problems.append(f"pretraining_tp={config.pretraining_tp} (older transformers releases then compute the "
                        "projections in tensor-parallel slices; set pretraining_tp to 1 in its config.json: the "
                        "function is the same up to rounding)")
    if config.hidden_act not in HIDDEN_ACTIVATIONS:
        problems.append(f"hidden_act={config.hidden_act!r} (the zoo has {HIDDEN_ACTIVATIONS}; a source with "
                        "another activation does not convert)")
    try:
        source_rope(config)
    except ValueError as error:
        problems.append(str(error).rstrip("."))
    if problems:
        raise ValueError(f"this {model_type} checkpoint does not map to the attnzoo backbone: "
                         + "; ".join(problems) + ".")


def source_biases(config) -> tuple[bool, bool, bool]:
    """(q/k/v bias, output-projection bias, feed-forward bias) of a source: Llama reads its config, Qwen2 always has
    q/k/v biases and no others, Mistral has none (as their modeling code builds them)."""
    if config.model_type == "qwen2":
        return True, False, False
    if config.model_type == "mistral":
        return False, False, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias, bool(getattr(config, "mlp_bias", False))


def target_config(source_config, family: str, overrides: dict | None = None):
    """The attnzoo config of `family` whose backbone computes what `source_config`'s model computes."""
    check_source_config(source_config)
    rope_theta, rope_scaling = source_rope(source_config)
    qkv_bias, output_bias, mlp_bias = source_biases(source_config)
    heads = source_config.num_attention_heads
    fixed = dict(vocab_size=source_config.vocab_size, hidden_size=source_config.hidden_size,
                 num_hidden_layers=source_config.num_hidden_layers, num_attention_heads=heads,
                 num_key_value_heads=getattr(source_config, "num_key_value_heads", None) or heads,
                 intermediate_size=source_config.intermediate_size, hidden_act=source_config.hidden_act,
                 norm_type="rmsnorm", layer_norm_eps=source_config.rms_norm_eps, mlp_type="gated",
                 mlp_bias=mlp_bias, attention_bias=qkv_bias, attention_output_bias=output_bias, lm_head_bias=False,
                 position_embedding_type="rotary", rope_theta=rope_theta, rope_scaling=rope_scaling,
                 reversible=False, is_decoder=True, tie_word_embeddings=bool(source_config.tie_word_embeddings))
    if family in ("reformer", "hybrid"):  # their LSH and local layers: heads of hidden_size / heads, as the source's
        fixed["attention_head_size"] = None
    defaults = dict(hidden_dropout_prob=0.0,  # Llama has no residual or embedding dropout
                    attention_probs_dropout_prob=float(getattr(source_config, "attention_dropout", 0.0) or 0.0),
                    max_position_embeddings=source_config.max_position_embeddings,
                    initializer_range=source_config.initializer_range, bos_token_id=source_config.bos_token_id,
                    eos_token_id=source_config.eos_token_id, pad_token_id=source_config.pad_token_id,
                    use_cache=getattr(source_config, "use_cache", True))
    return build_config(family, fixed, defaults, overrides)


def source_kind(model) -> str:
    """"causal_lm" or "base" for a supported `...ForCausalLM` / `...Model`; ValueError for anything else."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        check_source_config(model.config)  # an unsupported model type: name what does not map
        raise ValueError(f"{name} does not map: convert a {' / '.join(sorted(ARCHITECTURES))} (a ...ForCausalLM -> "
                         "ForCausalLM, a ...Model -> the base decoder).")
    return ARCHITECTURES[name]


def unknown_weights_error(keys, where: str) -> ValueError:
    keys = sorted(keys)
    hint = ""
    if any(key.endswith(QK_NORM_WEIGHTS) for key in keys):
        hint = (" (q_norm / k_norm are qk-norm, as in Qwen3: no attnzoo attention normalises queries and keys, so "
                "such a checkpoint does not convert)")
    return ValueError(f"{where} weights the Llama mapping does not know: {keys[:5]}{hint}; nothing was converted.")


def convert_state_dict(state: dict[str, torch.Tensor], source_config, model, kind: str,
                       report: ConversionReport) -> dict[str, torch.Tensor]:
    """The attnzoo tensors of `model` from a Llama / Qwen2 / Mistral state dict; ValueError naming any source key
    left unmapped."""
    remaining = dict(state)
    src_prefix = "model." if kind == "causal_lm" else ""
    dst_prefix = "model." if kind == "causal_lm" else ""
    _, _, mlp_bias = source_biases(source_config)

    def take(name: str) -> torch.Tensor:
        key = src_prefix + name
        if key not in remaining:
            raise ValueError(f"the source has no {key!r}; it is not a complete {source_config.model_type} checkpoint.")
        return remaining.pop(key)

    def linear(name: str, bias: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of an nn.Linear; bias=None takes the bias when there is one (the attention's projections:
        `attention_weights` checks it against the target)."""
        weight = take(f"{name}.weight")
        if bias is None:
            return weight, remaining.pop(f"{src_prefix}{name}.bias", None)
        return weight, take(f"{name}.bias") if bias else None

    out = {f"{dst_prefix}embed_tokens.weight": take("embed_tokens.weight")}
    base = model.model if kind == "causal_lm" else model
    for i, block in enumerate(base.transformer.blocks):
        src, dst = f"layers.{i}.", f"{dst_prefix}transformer.blocks.{i}."
        out[dst + "attn_norm.weight"] = take(src + "input_layernorm.weight")
        projections = {role: linear(f"{src}self_attn.{role}_proj", None) for role in "qkvo"}
        names = {role: f"{src_prefix}{src}self_attn.{role}_proj" for role in "qkvo"}
        out.update(attention_weights(block.attn, dst + "attn.", projections, report, names))
        out[dst + "ffn_norm.weight"] = take(src + "post_attention_layernorm.weight")
        for name in ("gate_proj", "up_proj", "down_proj"):
            weight, bias = linear(f"{src}mlp.{name}", mlp_bias)
            out[f"{dst}ffn.{name}.weight"] = weight
            if bias is not None:
                out[f"{dst}ffn.{name}.bias"] = bias
        for buffer in ROTARY_BUFFERS:
            remaining.pop(f"{src_prefix}{src}self_attn.{buffer}", None)
    out[f"{dst_prefix}transformer.final_norm.weight"] = take("norm.weight")
    remaining.pop(f"{src_prefix}{ROTARY_BUFFERS[0]}", None)
    if kind == "causal_lm":
        out["lm_head.weight"] = remaining.pop("lm_head.weight", out["model.embed_tokens.weight"])
    if remaining:
        raise unknown_weights_error(remaining, "source")
    return out


def convert(source, family: str = "softmax", overrides: dict | None = None, seed: int = 0, report=None):
    """An attnzoo model of `family` with the weights of `source` (a supported `...ForCausalLM` or `...Model`, see
    `ARCHITECTURES`), in the source's dtype and training mode; a causal LM takes the source's generation config.
    `overrides`: attention settings of the family's config (e.g. num_random_features)."""
    from transformers import AutoModel, AutoModelForCausalLM

    kind = source_kind(source)
    report = report if report is not None else ConversionReport()
    config = target_config(source.config, family, overrides)
    if kind == "causal_lm" and config.tie_word_embeddings:
        lm_head, embedding = source.lm_head.weight, source.model.embed_tokens.weight
        if lm_head.data_ptr() != embedding.data_ptr() and not torch.equal(lm_head, embedding):
            raise ValueError("the source says tie_word_embeddings=True but lm_head.weight differs from "
                             "model.embed_tokens.weight; fix its config (tie_word_embeddings=False).")
    auto_class = AutoModelForCausalLM if kind == "causal_lm" else AutoModel
    with seeded(seed):
        # built in the source's dtype rather than cast afterwards: `.to(dtype)` would also round the float32 rotary
        # table (a buffer) to bfloat16, whereas the source's table stays float32 (rotary.py)
        model = auto_class.from_config(config, dtype=next(source.parameters()).dtype)
    init_attention_extras(model)
    state = convert_state_dict(source.state_dict(), source.config, model, kind, report)
    load_converted(model, state, report)
    if kind == "causal_lm":  # decoding settings (eos ids, lengths, sampling defaults) stay the source's
        model.generation_config = copy.deepcopy(source.generation_config)
    return model.train(source.training)


def load_source(src: str):
    """The model class its config names (`ARCHITECTURES`) from a folder, a Hub id or a GGUF checkpoint
    (`load_gguf_source`), in eval mode; ValueError for a config that does not map or weights the mapping does not
    know, before anything is converted."""
    import transformers
    from transformers import AutoConfig

    from attnzoo.training.model_source import gguf_checkpoint, reading_model_source

    gguf = gguf_checkpoint(src, "SRC")
    if gguf is not None:
        return load_gguf_source(src, gguf)
    with reading_model_source(src, "SRC", takes_gguf=True):
        config = AutoConfig.from_pretrained(src)
    check_source_config(config)
    names = [a for a in (config.architectures or [CAUSAL_LM_CLASSES[config.model_type]]) if a in ARCHITECTURES]
    if not names:
        raise ValueError(f"{src} is a {config.architectures} checkpoint; only {sorted(ARCHITECTURES)} convert.")
    model_class = getattr(transformers, names[0])
    model, info = model_class.from_pretrained(src, dtype="auto", output_loading_info=True)
    # from_pretrained skips weights it does not know and initialises ones it does not find; neither may happen here
    unexpected = [k for k in info["unexpected_keys"] if not k.endswith(ROTARY_BUFFERS)]
    if unexpected:
        raise unknown_weights_error(unexpected, f"{src} holds")
    if info["missing_keys"]:
        raise ValueError(f"{src} lacks weights of {model_class.__name__}: {sorted(info['missing_keys'])[:5]}.")
    return model.eval()


#: GGUF metadata (`{general.architecture}.NAME`) that transformers' GGUF loader reads into a Llama / Qwen2 / Mistral
#: config; `gguf_settings_not_read` names any other
GGUF_CONFIG_KEYS = ("context_length", "block_count", "feed_forward_length", "embedding_length", "vocab_size",
                    "rope.dimension_count", "rope.freq_base", "attention.head_count", "attention.head_count_kv",
                    "attention.layer_norm_rms_epsilon")
#: llama.cpp's name of each per-layer tensor of a Llama / Qwen2 / Mistral GGUF -> the source module it fills
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
#: why a GGUF tensor the mapping does not take matters, where it is a known one
GGUF_TENSOR_HINTS = {
    "rope_freqs.weight": "per-frequency rope scaling factors (Llama 3.1's \"llama3\" rope scaling), which "
                         "transformers' GGUF loader does not apply",
}


def gguf_settings_not_read(metadata: dict, config) -> list[str]:
    """The `key=value` of every architecture setting of a GGUF file that transformers' loader leaves out of the
    config (rope scaling, a sliding window, experts, ...) and that changes the function: the model it builds would
    not compute what the file describes. Settings that restate the config (key/value widths of hidden / heads, zero
    experts, rope scaling "none") pass."""
    architecture = metadata["general.architecture"]
    head_width = config.hidden_size // config.num_attention_heads
    restated = {"attention.key_length": head_width, "attention.value_length": head_width, "expert_count": 0,
                "expert_used_count": 0, "rope.scaling.type": "none"}
    problems = []
    for key, value in metadata.items():
        name = key.removeprefix(f"{architecture}.")
        if name == key or name in GGUF_CONFIG_KEYS or (name in restated and value == restated[name]):
            continue
        problems.append(f"{key}={value!r}")
    return problems


def gguf_tensor_names(model) -> set[str]:
    """llama.cpp's names of the tensors a GGUF of `model` (a Llama / Qwen2 / Mistral causal LM) holds: the ones
    transformers' GGUF loader fills it from."""
    names = {"token_embd.weight", "output_norm.weight"}
    if not model.config.tie_word_embeddings:
        names.add("output.weight")
    for index, layer in enumerate(model.model.layers):
        for gguf_name, module_name in GGUF_LAYER_TENSORS.items():
            module = layer.get_submodule(module_name)
            names.update(f"blk.{index}.{gguf_name}.{kind}" for kind in ("weight", "bias")
                         if getattr(module, kind, None) is not None)
    return names


def load_gguf_source(src: str, gguf):
    """The causal LM of a GGUF checkpoint `gguf` (a llama.cpp file of a Llama, Qwen2 or Mistral model), read by
    transformers' GGUF loader and dequantised (to float32, which the loader gives for quantised and float16 files
    alike). ValueError before the weights are read for another architecture, a config that does not map or a
    setting transformers' loader does not read, and after for a tensor it skipped or a weight it did not find."""
    import transformers

    from attnzoo.training.model_source import gguf_contents, load_gguf_config, load_gguf_model

    metadata, tensors = gguf_contents(gguf)
    config = load_gguf_config(gguf, "SRC")
    if config.model_type not in CAUSAL_LM_CLASSES:
        why = "" if config.model_type == "gpt2" else UNSUPPORTED_MODEL_TYPES.get(config.model_type, "")
        raise ValueError(f"SRC {src}: {gguf.name} is a GGUF of a {config.model_type!r} model "
                         f"(general.architecture={metadata.get('general.architecture')!r}); only GGUF files of "
                         f"{sorted(CAUSAL_LM_CLASSES)} models convert{f' ({why})' if why else ''}. (attnzoo's other "
                         "converters read saved folders and Hub ids, not GGUF files.)")
    check_source_config(config)
    not_read = gguf_settings_not_read(metadata, config)
    if not_read:
        raise ValueError(f"SRC {src}: {gguf.name} sets {not_read}, which transformers' GGUF loader does not read: "
                         "the model it builds, and so the conversion, would not compute what the file describes. "
                         "Convert the original checkpoint instead (a folder with config.json, or its Hub id).")
    model_class = getattr(transformers, CAUSAL_LM_CLASSES[config.model_type])
    model, missing = load_gguf_model(gguf, model_class, "SRC", config)
    unknown = sorted(set(tensors) - gguf_tensor_names(model))
    if unknown:
        hints = "".join(f"; {name}: {GGUF_TENSOR_HINTS[name]}" for name in unknown if name in GGUF_TENSOR_HINTS)
        raise ValueError(f"SRC {src}: {gguf.name} holds tensors the Llama mapping does not know: {unknown[:5]}"
                         f"{hints}. transformers' GGUF loader skips them, so nothing was converted; convert the "
                         "original checkpoint instead (a folder with config.json, or its Hub id).")
    if missing:
        raise ValueError(f"SRC {src}: {gguf.name} lacks weights of {model_class.__name__}: {missing[:5]}.")
    return model.eval()


def load_tokenizer(src: str):
    return load_text_tokenizer(src)


def main(argv=None) -> None:
    text_converter_main(__doc__, "python -m attnzoo.convert.llama",
                        "LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM (or ...Model) checkpoint: a folder, "
                        "a Hub id, or a GGUF file (or a folder holding one)", load_source, convert, argv)


if __name__ == "__main__":
    main()
