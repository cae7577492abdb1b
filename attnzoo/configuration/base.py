"""The configuration every attnzoo family extends.

`ZooConfig` holds what the shared backbone needs (sizes, the per-layer attention pattern, residual kind, chunking,
position embeddings, image options). A family config subclasses it, sets its own `model_type`, changes defaults and
adds the fields its attention reads, and checks them by extending `validate_architecture`, which `__post_init__`
calls: a bad value raises `ValueError` naming the field and what to change. Attention names in `attn_layers` are
checked where the blocks are built, against the registry of attention modules. Overrides given to `from_pretrained`
are checked the same way, and attention kinds they add against the registry where it is loaded (`from_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import sys

from transformers import PreTrainedConfig

from attnzoo.configuration.rope import check_rope
from attnzoo.remote_code import PACKAGE, auto_map, write_remote_code
from attnzoo.transformers_compat import CACHE_NAMES, config_loading_options, loaded_for_another_loader
from attnzoo.validation import check_choice, check_int, check_positive_ints, check_probability, fail

logger = logging.getLogger(__name__)

POSITION_EMBEDDING_TYPES = ("learned", "sinusoidal", "axial", "rotary", "none")
NORM_TYPES = ("layernorm", "rmsnorm")
MLP_TYPES = ("standard", "gated")
POOLING_TYPES = ("mean", "cls", "last")
#: how a layer's far part sees positions, and how its queries may scale (attnzoo/modeling/attention/far_positions.py)
FAR_POSITIONS = ("rotary", "none", "fixed", "grouped")
FAR_QUERY_SCALES = ("log", "learned")
#: the fields of `ZooWindowSettings` (configuration/window.py), which every family's config had before
WINDOW_SETTINGS = ("window_size", "num_sink_tokens")
MODALITIES = ("text", "image")
REVERSIBLE_MERGES = ("mean", "concat")
HIDDEN_ACTIVATIONS = ("gelu", "relu", "silu", "gelu_new", "gelu_pytorch_tanh", "tanh")


#: other projects' names for attnzoo settings, accepted as keyword arguments and stored under attnzoo's name:
#: transformers' Reformer (`num_hashes`, `num_buckets`, `hash_seed`, `lsh_attn_chunk_length`,
#: `local_attn_chunk_length`, `feed_forward_size`) and performer-pytorch (`nb_features`)
PEER_SPELLINGS = {
    "num_hashes": "lsh_num_hashes",
    "num_buckets": "lsh_num_buckets",
    "hash_seed": "lsh_hash_seed",
    "lsh_attn_chunk_length": "lsh_chunk_length",
    "local_attn_chunk_length": "local_chunk_length",
    "feed_forward_size": "intermediate_size",
    "nb_features": "num_random_features",
    # attnzoo's own older names: configs saved with them load with the same behaviour
    "lsh_window": "lsh_attend_to",
}
#: keys transformers writes into or passes through a config besides its fields (they vary between releases)
_TRANSFORMERS_EXTRA_KEYS = {
    "auto_map", "model_type", "name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
    "tokenizer_class", "id2label", "label2id", "num_labels", "problem_type", "prefix", "task_specific_params",
    "finetuning_task", "attn_implementation", "experts_implementation", "quantization_config", "use_bfloat16",
    "pruned_heads", "tf_legacy_loss", "torchscript", "output_attentions", "output_hidden_states", "return_dict",
    "sep_token_id", "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
}


@functools.cache
def transformers_config_keys() -> frozenset[str]:
    """Names transformers' `PreTrainedConfig` itself accepts: its fields and attributes on the installed release,
    generation settings (older configs carry them), and the extra keys above."""
    from transformers import GenerationConfig

    names = set(dir(PreTrainedConfig)) | set(getattr(PreTrainedConfig, "__dataclass_fields__", {}))
    return frozenset(names | set(GenerationConfig().to_dict()) | _TRANSFORMERS_EXTRA_KEYS)


#: the module whose `ATTENTION_REGISTRY` holds the attention kinds; never imported from here (a configuration travels
#: without the modeling code), only looked up where it is loaded
_REGISTRY_MODULE = "attnzoo.modeling.attention.base"


def registered_attention_kinds() -> dict | None:
    """attnzoo's attention registry (kind -> class), where its modeling code is loaded. None where it is not, and
    in a checkpoint's copy of this module (transformers loads the copy of the modeling code apart from it): the
    kinds are then checked when the model is built."""
    if __name__.split(".")[0] != PACKAGE:
        return None
    return getattr(sys.modules.get(_REGISTRY_MODULE), "ATTENTION_REGISTRY", None)


def default_num_random_features(head_dim: int) -> int:
    """Random features per head when none is set: round(d · ln d), at least 1 (see ZooPerformerConfig)."""
    return max(1, round(head_dim * math.log(max(head_dim, 1))))


def _near_square_factors(n: int) -> tuple[int, int]:
    """The factor pair (a, b) of the smallest power of two >= n with a*b >= n and a, b as close as possible."""
    total = 1 << max(0, (n - 1).bit_length())
    a = 1 << (int(math.log2(total)) // 2)
    return a, total // a


def family_configs_with(field: str) -> list[str]:
    """The names of the family configs (the `ZooConfig` classes with a `model_type` of their own) that have
    `field`, among those imported."""
    found, todo = set(), [ZooConfig]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "model_type" in vars(cls) and cls is not ZooConfig and field in cls.__dataclass_fields__:
            found.add(cls.__name__)
    return sorted(found)


def family_configs_based_on(class_names: tuple[str, ...]) -> list[str]:
    """The names of the family configs whose classes include every class named in `class_names` (the settings an
    attention reads, its `family_config`), among those imported."""
    found, todo = set(), [ZooConfig]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "model_type" in vars(cls) and cls is not ZooConfig and \
                set(class_names) <= {base.__name__ for base in cls.__mro__}:
            found.add(cls.__name__)
    return sorted(found)


class ZooConfig(PreTrainedConfig):
    r"""
    Shared configuration of every attnzoo model. Standard transformers names are used where one exists. A keyword
    that is not a setting raises `ValueError` naming the closest one; other projects' names listed in
    `PEER_SPELLINGS` (transformers' Reformer `num_hashes`, performer-pytorch's `nb_features`, ...) set attnzoo's.

    Args:
        vocab_size: token vocabulary (256 for byte-level models).
        hidden_size / num_hidden_layers / num_attention_heads / intermediate_size: Transformer sizes;
            `hidden_size` must be divisible by `num_attention_heads`.
        hidden_act: feed-forward activation, one of `HIDDEN_ACTIVATIONS`.
        max_position_embeddings: longest sequence the position embeddings cover.
        hidden_dropout_prob / attention_probs_dropout_prob: dropout after each sub-layer / on attention weights.
        drop_path_rate: stochastic depth, linearly increased over the layers (DeiT).
        attention_bias / lm_head_bias: biases in the attention projections / in the language-model head (off by
            default; transformers' Reformer has one in its head from 5.24 on, which its converter carries).
        attention_output_bias: a bias in the attention's output projection; `None` follows `attention_bias`
            (Qwen2 has biases on q, k and v but none on the output: `attention_bias=True, attention_output_bias=False`).
        num_key_value_heads: key/value heads of grouped-query attention (`None`: one per query head; 1:
            multi-query). It must divide `num_attention_heads`; every group of query heads reads one key/value head
            ("GQA", arXiv 2305.13245). How each attention kind uses the groups: docs/llama_backbones.md.
        norm_type: "layernorm" (the default) or "rmsnorm" (no mean, no bias; Llama's), for every normalisation
            of the stack, with epsilon `layer_norm_eps`.
        mlp_type: "standard" (`fc_in`, activation, `fc_out`) or "gated" (Llama's `down_proj(act(gate_proj(x)) *
            up_proj(x))`, usually with `hidden_act="silu"`). `mlp_bias` switches the feed-forward's biases.
        classifier_dropout: dropout before a classification head (defaults to `hidden_dropout_prob`).
        attn_layers: attention kind per layer, names from `attnzoo.ATTENTION_REGISTRY`; a shorter list repeats to
            `num_hidden_layers` (e.g. `["local", "lsh"]`), a longer one is refused (the family's default pattern is
            fitted to a shallower stack).
        is_decoder: causal self-attention (a decoder-only LM). Encoder-decoder models set `is_encoder_decoder`.
        num_decoder_layers / decoder_attn_layers: the decoder of an encoder-decoder model (default: same depth,
            exact softmax self-attention; the RA/LARA paper, arXiv 2204.04667 §5.4, uses efficient attention only in
            the encoder).
        reversible: reversible residual stack (Reformer, arXiv 2001.04451, §3): activations are recomputed in the
            backward pass.
        reversible_merge: how the reversible stack's two streams become the output: "mean" (width hidden_size) or
            "concat" (width 2 * hidden_size, the final LayerNorm and the heads read both streams side by side, as in
            trax's and transformers' Reformer; needs `tie_word_embeddings=False`). See `stack_output_size`.
        chunk_size_feed_forward: process the feed-forward in sequence chunks of this size (0 = one chunk).
        loss_chunk_size: compute the LM head and loss in sequence chunks of this size, recomputing the logits in the
            backward pass, so [batch, length, vocab] logits are never held (0 = off).
        position_embedding_type: "learned", "sinusoidal", "axial" (Reformer's factorised table), "rotary" (RoPE,
            "RoFormer", arXiv 2104.09864: q and k of every attention are rotated by position before the attention's
            own mechanism; no position is added to the embeddings and no length limit applies) or "none".
        far_positions: per layer (a shorter list repeats), how the layer's far (global) part sees positions in rotary
            models: "rotary" (the default), "none" (the queries and keys before rotation: a windowed layer's far
            part, or a whole "full" layer, which becomes a global layer without positions; the iRoPE / RNoPE-SWA
            pattern is e.g. `attn_layers=[lsh_window, lsh_window, lsh_window, full]` with
            `far_positions=[rotary, rotary, rotary, none]`) or "fixed" (windowed layers: every far key read at the
            distance `window_size`, the nearest a far key can be, as InfLLM and LM-Infinite read a pretrained
            model's far keys, so no far key meets a rotary distance the model did not train on) or "grouped"
            (windowed layers: Self-Extend's grouped positions, a far key's distance from the window's edge divided
            by `far_position_group`, so distances grow G times slower than the context). Only windowed attentions
            and "full" have such a part.
        far_position_group: G of "grouped" far positions (required with it, refused without it): a far key at
            distance d >= window_size is read at window_size + (floor(i/G) - floor(j/G) - floor(window_size/G)), so
            a model trained on N tokens reads about G (N - window_size) tokens without meeting a longer distance.
        far_query_scale / far_query_scale_length: scaling of the queries of the far parts without rotary distances
            ("none", "fixed" or "grouped") with the log of the position: None, "log" (Llama 4's
            1 + 0.1 ln(floor((p + 1) / far_query_scale_length) + 1)) or "learned" (scalable-softmax's s ln(p + 1),
            s per head). See attnzoo/modeling/attention/far_positions.py.
        far_kv_heads: per layer (a shorter list repeats), the key-value heads of a windowed layer that keep its far
            part: `None` (the default, and an entry `None`: every head) or a list of key-value head indices; the
            query heads of the other key-value heads attend to their window and sinks only, and the far part's
            decoding state holds the listed heads alone (DuoAttention's retrieval and streaming heads, arXiv
            2410.10819, §3; `attnzoo.evaluation.retrieval_layers` chooses them without training). Only windowed
            attentions with a far part may list heads; a layer that should keep none is a "window" layer.
        rope_theta / rope_scaling: the rotary base, and its frequency scaling: `None`, or a dict with "rope_type"
            (or "type") one of `ROPE_SCALING_TYPES`: "default", "linear" (with "factor") or "llama3" (with
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), as transformers'
            Llama reads them. Other types (dynamic NTK, YaRN, LongRoPE) are refused.
        axial_pos_shape / axial_pos_embds_dim: the axial factorisation; the shape's product must cover
            `max_position_embeddings` and the dims must sum to `hidden_size` (derived when left `None`).
        image_size / patch_size / num_channels: image models (DeiT-style patch embedding).
        modality: what the base model embeds: "text" (token ids) or "image" (pixel values, patch embeddings).
            Image-classification heads set "image", so their backbone, saved alone, loads as an image encoder.
        pooling: how a classification head summarises a sequence: "mean" (over non-padded tokens), "cls" (a
            learned class token for images, the first token for text) or "last" (the last non-padded token).
        eval_seed: seed of the random draws attentions make in evaluation mode (LSH's hash rotations, RA's sampled
            indices), so `model.eval()` gives the same outputs on every call, whatever the batch, and cached decoding
            equals the full forward. Training stays random. `None` draws from the global RNG in evaluation too
            (stochastic evaluation, e.g. to average several draws).
    """

    model_type = "attnzoo"
    # Outputs the Trainer leaves out of evaluation predictions: the decoding cache, under every name it has had.
    keys_to_ignore_at_inference = list(CACHE_NAMES)

    vocab_size: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    drop_path_rate: float = 0.0
    classifier_dropout: float | None = None
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    attention_bias: bool = True
    attention_output_bias: bool | None = None
    lm_head_bias: bool = False
    num_key_value_heads: int | None = None
    norm_type: str = "layernorm"
    mlp_type: str = "standard"
    mlp_bias: bool = True

    attn_layers: list[str] | tuple[str, ...] = ("full",)
    is_decoder: bool = False
    num_decoder_layers: int | None = None
    decoder_attn_layers: list[str] | tuple[str, ...] = ("full",)

    reversible: bool = False
    reversible_merge: str = "mean"
    loss_chunk_size: int = 0

    position_embedding_type: str = "learned"
    axial_pos_shape: list[int] | tuple[int, ...] | None = None
    axial_pos_embds_dim: list[int] | tuple[int, ...] | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    far_positions: list[str] | tuple[str, ...] = ("rotary",)
    far_query_scale: str | None = None
    far_query_scale_length: int = 8192
    far_position_group: int | None = None
    far_kv_heads: list[list[int] | None] | None = None

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    modality: str = "text"
    pooling: str = "mean"
    eval_seed: int | None = 0

    tie_word_embeddings: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    decoder_start_token_id: int | None = None

    def __post_init__(self, **kwargs):
        kwargs = self._settings_from_other_names(kwargs)
        # the sizes the defaults below are derived from, checked first (a string would fail in the arithmetic)
        check_positive_ints(self, ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "max_position_embeddings"))
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_hidden_layers
        self.attn_layers = self._fit_layout("attn_layers", "num_hidden_layers")
        self.decoder_attn_layers = self._fit_layout("decoder_attn_layers", "num_decoder_layers")
        if hasattr(self, "num_random_features") and self.num_random_features is None:
            self.num_random_features = default_num_random_features(self.hidden_size // self.num_attention_heads)
        if self.position_embedding_type == "axial":
            if self.axial_pos_shape is None:
                self.axial_pos_shape = _near_square_factors(self.max_position_embeddings)
            if self.axial_pos_embds_dim is None:
                half = self.hidden_size // 2
                self.axial_pos_embds_dim = (half, self.hidden_size - half)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        if isinstance(self.far_positions, tuple):
            self.far_positions = list(self.far_positions)
        if isinstance(self.far_kv_heads, list | tuple):
            self.far_kv_heads = [list(entry) if isinstance(entry, list | tuple) else entry
                                 for entry in self.far_kv_heads]
        if self.axial_pos_shape is not None:
            self.axial_pos_shape = list(self.axial_pos_shape)
        if self.axial_pos_embds_dim is not None:
            self.axial_pos_embds_dim = list(self.axial_pos_embds_dim)
        super().__post_init__(**kwargs)
        self.validate_architecture()

    def _check_far_positions(self) -> None:
        entries = list(self.far_positions) if isinstance(self.far_positions, list | tuple) else None
        if not entries or any(entry not in FAR_POSITIONS for entry in entries):
            fail("far_positions", self.far_positions, f"list one of {list(FAR_POSITIONS)} per layer (a shorter list "
                                                      "repeats), e.g. ['rotary', 'rotary', 'rotary', 'none'].")
        if len(entries) > max(self.num_hidden_layers, self.num_decoder_layers or 0):
            fail("far_positions", entries, f"it lists {len(entries)} entries for {self.num_hidden_layers} layers; give "
                                           "at most one per layer.")
        if {"none", "fixed", "grouped"} & set(entries) and self.position_embedding_type != "rotary":
            fail("far_positions", entries, "'none', 'fixed' and 'grouped' change how the far part reads rotary "
                                           "positions, but "
                                           f"position_embedding_type={self.position_embedding_type!r}; set "
                                           "position_embedding_type='rotary' or far_positions=['rotary'].")
        check_choice(self, "far_query_scale", (None, *FAR_QUERY_SCALES))
        if self.far_query_scale is not None and not {"none", "fixed", "grouped"} & set(entries):
            fail("far_query_scale", self.far_query_scale, "it scales the queries of far parts without rotary "
                                                          "distances, and no layer has one; set far_positions (e.g. "
                                                          "['none'] or ['fixed']) or far_query_scale=None.")
        check_positive_ints(self, ("far_query_scale_length",))
        if "grouped" in entries and self.far_position_group is None:
            fail("far_position_group", None, "far_positions lists 'grouped', which reads far keys at distances divided "
                                             "by this group size; set it (e.g. 4 to read about four times the "
                                             "training length) or use far_positions 'fixed'.")
        if self.far_position_group is not None:
            if "grouped" not in entries:
                fail("far_position_group", self.far_position_group, "it is the group size of 'grouped' far "
                                                                    "positions, and no layer has them; list 'grouped' "
                                                                    "in far_positions or set it to None.")
            check_positive_ints(self, ("far_position_group",))

    def _check_far_kv_heads(self) -> None:
        entries = self.far_kv_heads
        if entries is None:
            return
        heads = self.num_key_value_heads
        example = f"[None, [0], {list(range(min(heads, 2)))}]"
        if not isinstance(entries, list) or not entries:
            fail("far_kv_heads", entries, f"list, per layer, None (every head) or the key-value heads that keep the "
                                          f"far part, e.g. {example}; or set it to None.")
        if len(entries) > max(self.num_hidden_layers, self.num_decoder_layers or 0):
            fail("far_kv_heads", entries, f"it lists {len(entries)} entries for {self.num_hidden_layers} layers; give "
                                          "at most one per layer.")
        for layer, entry in enumerate(entries):
            if entry is None:
                continue
            if not isinstance(entry, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in entry):
                fail("far_kv_heads", entries, f"entry {layer} is {entry!r}; give None or a list of key-value head "
                                              f"indices, e.g. {example}.")
            if not entry:
                fail("far_kv_heads", entries, f"entry {layer} lists no head; a layer without a far part is a 'window' "
                                              "layer: name it so in attn_layers and give it None here.")
            if len(set(entry)) != len(entry) or not all(0 <= h < heads for h in entry):
                fail("far_kv_heads", entries, f"entry {layer} ({entry}) must list distinct key-value heads in 0.."
                                              f"{heads - 1} (num_key_value_heads={heads}).")

    def _fit_layout(self, name: str, depth_name: str) -> list[str]:
        """`attn_layers` (or `decoder_attn_layers`) as a list of at most one kind per layer. A list longer than the
        stack is refused, naming both numbers, unless it is the class default, which is fitted to the depth
        (`default_layout`); a shorter list repeats (`layer_attention_kinds`)."""
        value = getattr(self, name)
        if isinstance(value, str) or not isinstance(value, list | tuple) or not all(isinstance(k, str) for k in value):
            # a bare string would become a list of its characters, one "kind" per letter
            fail(name, value, f"give a list of attention kinds, one per layer (a shorter list repeats), e.g. "
                              f"{name}=[{value!r}]." if isinstance(value, str) else
                              "give a list of attention kinds (strings), one per layer.")
        layers, depth = list(value), getattr(self, depth_name)
        if not isinstance(depth, int) or len(layers) <= depth:
            return layers  # a depth that is not a positive integer fails in validate_architecture
        if layers == list(self.__dataclass_fields__[name].default):
            return self.default_layout(name, depth)
        fail(name, layers, f"it lists {len(layers)} attention kinds for {depth} layers ({depth_name}={depth}); give "
                           f"at most one kind per layer (a shorter list repeats to the depth), or set {depth_name} "
                           f"to {len(layers)}.")

    def default_layout(self, name: str, depth: int) -> list[str]:
        """The class default of `name` for a stack of `depth` layers shallower than it: the pattern's first `depth`
        kinds (families override this where that would lose the pattern's point)."""
        return list(self.__dataclass_fields__[name].default)[:depth]

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' loading of a saved config, where `from_pretrained(path, **overrides)` ends (so do
        `AutoConfig.from_pretrained` and `AutoModel*.from_pretrained(path, **overrides)`), with the overrides in
        `kwargs`.

        Overrides are checked as constructor arguments: the settings among them (and other projects' names for
        settings, `PEER_SPELLINGS`) go to `__init__` with the saved values, so a bad value raises the `ValueError`
        the constructor raises, naming the field and what to change; attention kinds new to `attn_layers` must be
        registered. transformers would set the other keywords after the checks when they name an attribute, and
        drop the rest without a word. An attribute that is not a setting (`head_dim`, a method) is refused, and so
        is a dropped keyword, naming the closest setting, unless it is one of transformers' loading options
        (`config_loading_options`), the caller asked for the unused keywords back (`return_unused_kwargs=True`, as
        the model loaders do: a model's own options pass through here) or another of transformers' loaders reads
        the config for itself and passes its own options through (`AutoTokenizer.from_pretrained(path,
        padding_side="left")`, AutoProcessor, pipeline(): `loaded_for_another_loader`), which are left alone.

        Configs saved before layouts were checked against the depth may list more attention kinds than layers; the
        model was built from the first ones, which are kept, with a warning, so the checkpoint loads as it was
        trained."""
        config_dict = dict(config_dict)
        cls._drop_settings_saved_for_every_family(config_dict)
        depth = config_dict.get("num_hidden_layers")
        decoder_depth = config_dict.get("num_decoder_layers") or depth
        for name, layers_depth in (("attn_layers", depth), ("decoder_attn_layers", decoder_depth)):
            layers = config_dict.get(name)
            if isinstance(layers, list | tuple) and isinstance(layers_depth, int) and len(layers) > layers_depth > 0:
                logger.warning("this config lists %d kinds in %s for %d layers; the model uses the first %d, %s "
                               "(save it again to record that)", len(layers), name, layers_depth, layers_depth,
                               list(layers[:layers_depth]))
                config_dict[name] = list(layers[:layers_depth])
        return_unused_kwargs = kwargs.pop("return_unused_kwargs", False)
        config_dict.update(cls._take_overrides(kwargs, config_dict))
        config, unused = super().from_dict(config_dict, return_unused_kwargs=True, **kwargs)
        if not return_unused_kwargs:
            cls._refuse_dropped_keywords(unused)
        return (config, unused) if return_unused_kwargs else config

    @classmethod
    def _take_overrides(cls, kwargs: dict, saved: dict) -> dict:
        """The overrides in `kwargs` that are settings of this class (or another project's names for them), taken
        out of `kwargs` for `__init__` to check; the saved values they replace are removed from `saved`. `dtype`
        stays with transformers, which gives a concrete one to `__init__` itself and reads "auto" as the
        checkpoint's. A keyword naming an attribute of attnzoo's that is not a setting is refused: transformers
        would set it over a derived value or a method."""
        fields = {field.name for field in dataclasses.fields(cls)} - {"dtype"}
        overrides = {}
        for key in list(kwargs):
            if key in fields or PEER_SPELLINGS.get(key) in fields:
                overrides[key] = kwargs.pop(key)
            elif not key.startswith("_") and key not in transformers_config_keys() and \
                    any(key in vars(base) for base in cls.__mro__ if issubclass(base, ZooConfig)):
                raise cls._not_a_setting(key, kwargs[key])
        cls._check_new_attention_kinds(overrides, saved)
        replaced = {PEER_SPELLINGS.get(key, key) for key in overrides}
        for key in [key for key in saved if PEER_SPELLINGS.get(key, key) in replaced]:
            del saved[key]
        return overrides

    @classmethod
    def _check_new_attention_kinds(cls, overrides: dict, saved: dict) -> None:
        """Attention kinds that overrides of `attn_layers` / `decoder_attn_layers` bring in must be registered (and
        this class must have the settings they read), with the errors the model's construction gives. Only where the
        registry is loaded, and not for kinds the saved config has: the checkpoint's code may register those when
        the model is built."""
        registry = registered_attention_kinds()
        if registry is None:
            return
        known = {*registry, *(saved.get("attn_layers") or ()), *(saved.get("decoder_attn_layers") or ())}
        mro = {base.__name__ for base in cls.__mro__}
        for name in ("attn_layers", "decoder_attn_layers"):
            layers = overrides.get(name)
            for kind in layers if isinstance(layers, list | tuple) else ():
                if not isinstance(kind, str):
                    continue  # refused by the checks of __init__ or of the model
                if kind not in known:
                    fail(name, list(layers), f"unknown attention {kind!r}; known kinds: {sorted(registry)}. An "
                                             "attention of your own is known once the module that registers it is "
                                             "imported.")
                required = getattr(registry.get(kind), "family_config", ())
                required = (required,) if isinstance(required, str) else tuple(required)
                if missing := [setting for setting in required if setting not in mro]:
                    fail(name, list(layers), f"attention {kind!r} reads the settings of {' and '.join(missing)}, "
                                             f"which {cls.__name__} does not have; build the model with a config "
                                             f"that has them: {', '.join(family_configs_based_on(required))}.")

    @classmethod
    def _refuse_dropped_keywords(cls, unused: dict) -> None:
        """Refuse the first keyword that transformers left unused, and so would drop without a word, naming the
        closest setting; transformers' own config keys and loading options pass, and so does everything where
        another of transformers' loaders reads this config with its own options."""
        dropped = [key for key in unused if not key.startswith("_") and key not in transformers_config_keys()
                   and key not in config_loading_options()]
        if not dropped:
            return
        if loaded_for_another_loader(skip_modules=(__name__,)):
            logger.info("%s leaves %s to the loader that reads it", cls.__name__, ", ".join(dropped))
            return
        raise cls._not_a_setting(dropped[0], unused[dropped[0]])

    @classmethod
    def _drop_settings_saved_for_every_family(cls, config_dict: dict) -> None:
        """Configs saved before the window settings moved to the configs whose attentions have a window
        (`ZooWindowSettings`) carry `window_size` and `num_sink_tokens` in every family. Where this class has no
        such setting they were never read, unless the layers use a windowed attention (possible then in any family):
        such a config is refused, naming the config to load it with."""
        saved = [name for name in WINDOW_SETTINGS if name in config_dict and name not in cls.__dataclass_fields__]
        if not saved:
            return
        layouts = [*(config_dict.get("attn_layers") or ()), *(config_dict.get("decoder_attn_layers") or ())]
        windowed = sorted({kind for kind in layouts if kind == "window" or str(kind).endswith("_window")})
        if windowed:
            raise ValueError(f"this config's layers use {windowed}, whose settings ({', '.join(saved)}) "
                             f"{cls.__name__} does not have; load it with a config that has them, e.g. config = "
                             "ZooWindowConfig.from_pretrained(path), then ZooWindowForCausalLM.from_pretrained(path, "
                             "config=config) (the same backbone, so the weights load unchanged).")
        for name in saved:
            del config_dict[name]

    def _settings_from_other_names(self, kwargs: dict) -> dict:
        """Keyword arguments that are not fields: transformers' own config keys pass on; another project's name for
        one of this config's fields (`PEER_SPELLINGS`) sets that field; anything else is refused, naming the closest
        field, rather than kept as an attribute nothing reads."""
        fields = set(self.__dataclass_fields__)
        passed = {}
        for key, value in kwargs.items():
            target = PEER_SPELLINGS.get(key)
            if target in fields:
                if getattr(self, target) != self.__dataclass_fields__[target].default and \
                        getattr(self, target) != value:
                    raise ValueError(f"{key}={value!r} and {target}={getattr(self, target)!r} set the same thing "
                                     f"({key} is another name for {target}); pass only {target}.")
                setattr(self, target, value)
            elif key.startswith("_") or key in transformers_config_keys():
                passed[key] = value
            else:
                raise type(self)._not_a_setting(key, value)
        return passed

    @classmethod
    def _not_a_setting(cls, key: str, value) -> ValueError:
        """The error for a keyword argument `key` that is not a setting of this class: another project's name for a
        setting it lacks, another family's setting, a derived value, or the closest setting's name."""
        target = PEER_SPELLINGS.get(key)
        if target is not None:
            return ValueError(f"{key}={value!r}: {key} is another name for {target}, which {cls.__name__} does not "
                              f"have; use the family whose config has {target}.")
        if owners := family_configs_with(key):  # another family's setting, e.g. window_size in softmax
            return ValueError(f"{key}={value!r} is not a setting of {cls.__name__}; it is one of "
                              f"{', '.join(owners)}: build the model with one of those.")
        if hasattr(cls, key):  # e.g. head_dim
            return ValueError(f"{key}={value!r} is not a setting of {cls.__name__}: {key} is derived from its "
                              "settings (or a method), so it cannot be set; set the settings it comes from.")
        fields = set(cls.__dataclass_fields__)
        names = fields | {peer for peer, field in PEER_SPELLINGS.items() if field in fields}
        close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
        hint = f"; did you mean {PEER_SPELLINGS.get(close[0], close[0])!r}?" if close else \
            f"; see the {cls.__name__} docstring for its settings."
        return ValueError(f"{key}={value!r} is not a setting of {cls.__name__}{hint}")

    # -- validation -------------------------------------------------------------------------------------------
    def validate_architecture(self) -> None:
        """Raise `ValueError` naming the first invalid field and what to change. Families extend this with the
        fields they add."""
        super().validate_architecture()
        check_positive_ints(self, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "intermediate_size", "max_position_embeddings", "num_decoder_layers",
                                   "image_size", "patch_size", "num_channels"))
        if self.hidden_size % self.num_attention_heads:
            fail("num_attention_heads", self.num_attention_heads,
                 f"it must divide hidden_size={self.hidden_size}; pick a divisor or change hidden_size.")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate"):
            check_probability(self, name)
        check_probability(self, "classifier_dropout", optional=True)
        check_choice(self, "hidden_act", HIDDEN_ACTIVATIONS)
        check_choice(self, "norm_type", NORM_TYPES)
        check_choice(self, "mlp_type", MLP_TYPES)
        check_positive_ints(self, ("num_key_value_heads",))
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", self.num_key_value_heads,
                 f"it must divide num_attention_heads={self.num_attention_heads} (each key/value head serves a "
                 "group of query heads); pick a divisor, or None for one per query head.")
        if self.position_embedding_type == "rotary":
            check_rope(self)
        for name in ("chunk_size_feed_forward", "loss_chunk_size"):
            check_int(self, name, 0, "set 0 (no chunking) or a positive chunk length.")
        for name in ("attn_layers", "decoder_attn_layers"):
            if not getattr(self, name):
                fail(name, getattr(self, name), "list at least one attention kind, e.g. ['full'].")
        check_choice(self, "reversible_merge", REVERSIBLE_MERGES)
        if self.reversible_merge == "concat" and not self.reversible:
            fail("reversible_merge", self.reversible_merge, "two streams exist only with reversible=True; set "
                                                            "reversible=True or reversible_merge='mean'.")
        if self.reversible_merge == "concat" and self.tie_word_embeddings:
            fail("reversible_merge", self.reversible_merge, "the heads then read 2 * hidden_size features and cannot "
                                                            "share the input embedding; set tie_word_embeddings=False.")
        check_choice(self, "position_embedding_type", POSITION_EMBEDDING_TYPES)
        self._check_far_positions()
        self._check_far_kv_heads()
        if self.position_embedding_type == "axial":
            self._check_axial()
        check_choice(self, "pooling", POOLING_TYPES)
        check_choice(self, "modality", MODALITIES)
        check_int(self, "eval_seed", 0, "set a non-negative integer, or None for random draws at evaluation too.",
                  optional=True)
        if self.image_size % self.patch_size:
            fail("patch_size", self.patch_size, f"it must divide image_size={self.image_size}.")

    def _check_axial(self) -> None:
        shape, dims = self.axial_pos_shape, self.axial_pos_embds_dim
        if len(shape) != len(dims):
            fail("axial_pos_embds_dim", dims, f"give one dimension per axis of axial_pos_shape={shape}.")
        if sum(dims) != self.hidden_size:
            fail("axial_pos_embds_dim", dims, f"the dimensions must sum to hidden_size={self.hidden_size}.")
        if math.prod(shape) < self.max_position_embeddings:
            fail("axial_pos_shape", shape, f"its product {math.prod(shape)} must be >= max_position_embeddings="
                                            f"{self.max_position_embeddings}.")

    # -- saving -------------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """transformers' save, plus the code this config needs and its `auto_map` entry, so the folder (or Hub
        repository) loads with `AutoConfig.from_pretrained(..., trust_remote_code=True)` without attnzoo."""
        write_remote_code(save_directory, type(self))
        self.auto_map = {**(getattr(self, "auto_map", None) or {}), **auto_map(type(self), [])}
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def to_diff_dict(self) -> dict:
        """transformers' saved settings, less `rope_scaling` when it is None (our default): transformers' own config
        class, which `AutoTokenizer.from_pretrained(folder)` reads a folder's config.json with, takes a saved
        `rope_scaling` for its deprecated alias of `rope_parameters` and warns (FutureWarning) on every load."""
        saved = super().to_diff_dict()
        if saved.get("rope_scaling", False) is None:
            del saved["rope_scaling"]
        return saved

    # -- derived values ---------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def stack_output_size(self) -> int:
        """Width of the Transformer's output, which the heads read: 2 * hidden_size for concatenated streams."""
        return 2 * self.hidden_size if self.reversible and self.reversible_merge == "concat" else self.hidden_size

    def layer_attention_kinds(self, decoder: bool = False) -> list[str]:
        """The attention kind of every layer: `attn_layers` (or `decoder_attn_layers`) repeated to the depth."""
        names = self.decoder_attn_layers if decoder else self.attn_layers
        depth = self.num_decoder_layers if decoder else self.num_hidden_layers
        return [names[i % len(names)] for i in range(depth)]
