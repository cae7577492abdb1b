"""The `PreTrainedModel` base every attnzoo model shares, and the three base models the heads build on: the text
model (an encoder, or a causal decoder), the DeiT-style vision encoder and the encoder half of an encoder-decoder.
A family subclasses each with its own config class (see `modeling_softmax.py`); nothing here depends on the
attention kind."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPast

from attnzoo.configuration.base import ZooConfig
from attnzoo.modeling.attention import InitialisesBuffers, ZooAttention
from attnzoo.modeling.attention.far_positions import FarQueryScale
from attnzoo.modeling.backbone import ZooTransformer
from attnzoo.modeling.cache import ZooCache
from attnzoo.modeling.embeddings import AxialPositionEmbedding, PatchEmbedding
from attnzoo.modeling.rotary import RotaryEmbedding
from attnzoo.remote_code import auto_map, family_model_classes, write_remote_code
from attnzoo.transformers_compat import GenerationHooks, take_cache, with_cache


def embed_token_ids(embedding: nn.Embedding, ids: torch.Tensor, name: str = "input_ids") -> torch.Tensor:
    """`embedding(ids)` for (batch, length) integer token ids, with the errors saying what is wrong with `name`."""
    if ids.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}; expected (batch, length).")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {ids.dtype}; token ids are integers (e.g. tokenizer(..., "
                         "return_tensors='pt').input_ids, or ids.long()).")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(ids.shape)}): pass at least one token of one example.")
    try:
        return embedding(ids)
    except IndexError as error:  # the CPU's message is "index out of range in self"
        raise ValueError(f"{name} holds token ids outside [0, vocab_size={embedding.num_embeddings}): "
                         f"min {int(ids.min())}, max {int(ids.max())}. Use the model's tokenizer, or a config whose "
                         "vocab_size covers the ids.") from error


def as_output(output, return_dict, config):
    """The ModelOutput, or its tuple when `return_dict` (or, when it is None, `config.return_dict`) is False."""
    if return_dict is None:
        return_dict = config.return_dict
    return output if return_dict else output.to_tuple()


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be read (None if its header parses and its tensors lie inside the file). Read
    with the standard library only: this module travels as a checkpoint's remote code."""
    size = path.stat().st_size
    with path.open("rb") as file:
        start = file.read(8)
        if len(start) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        (header_size,) = struct.unpack("<Q", start)
        if 8 + header_size > size:
            return f"its header says {header_size} bytes of metadata, but the file has {size} bytes in all"
        try:
            header = json.loads(file.read(header_size))
        except ValueError as error:
            return f"its metadata is not JSON ({error})"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    if ends and 8 + header_size + max(ends) > size:
        return f"its tensors need {8 + header_size + max(ends)} bytes, but the file has {size}"
    return None


def damaged_weight_files(folder) -> list[str]:
    """The damaged .safetensors files of a local model folder, each with what is wrong ([] for a Hub id)."""
    folder = Path(str(folder))
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            found.append(f"{path.name} ({problem})")
    return found


class ZooPreTrainedModel(GenerationHooks, PreTrainedModel):
    config_class = ZooConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ZooBlock"]
    # LSH key centres (`lsh_centre_keys`) and centroids (`lsh_key_centroids`) are zero until calibrated
    # (attnzoo.convert.lsh_key_centres), the calibration of a checkpoint loaded with that setting turned on: not a
    # weight missing from it
    _keys_to_ignore_on_load_missing = [r"\.lsh_key_centre$", r"\.lsh_key_centroids$"]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, AxialPositionEmbedding):
            for weight in module.weights:
                init.normal_(weight, mean=0.0, std=std)
        elif isinstance(module, InitialisesBuffers):
            module.init_buffers()
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.table())
        elif isinstance(module, FarQueryScale):
            module.reset_parameters()
        elif isinstance(module, PatchEmbedding):
            if module.cls_token is not None:
                init.trunc_normal_(module.cls_token, std=std)
            if getattr(module, "position_embeddings", None) is not None:
                init.trunc_normal_(module.position_embeddings, std=std)

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """transformers' save (and Hub upload), plus the code of the model's family and an `auto_map` in
        config.json, so the checkpoint loads with `AutoModel*.from_pretrained(..., trust_remote_code=True)` where
        attnzoo is not imported or not installed (see `attnzoo.remote_code`)."""
        classes = family_model_classes(type(self))
        if is_main_process:  # the code is checked in full before anything is written
            attentions = dict.fromkeys(type(m) for m in self.modules() if isinstance(m, ZooAttention))
            write_remote_code(save_directory, type(self.config), classes, list(attentions))
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}),
                                **auto_map(type(self.config), classes)}
        return super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loading; when it fails on a local folder whose weight files are damaged (cut short while
        being written or copied), the error names the file instead of transformers' "incomplete metadata"."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except Exception as error:
            damaged = damaged_weight_files(pretrained_model_name_or_path)
            if not damaged:
                raise
            raise ValueError(f"{pretrained_model_name_or_path}: {'; '.join(damaged)}: the weights are damaged "
                             "(cut short or corrupted while being written or copied). Copy or save the model again."
                             ) from error

    def new_decoding_cache(self, max_cache_len: int | None = None):
        """An empty cache for incremental decoding (generative heads override this)."""
        raise ValueError(f"{type(self).__name__} does not decode incrementally; use a ForCausalLM or "
                         "ForConditionalGeneration model.")


class ZooModel(ZooPreTrainedModel):
    """The base model every head builds on. Text (`config.modality="text"`): token embeddings and the Transformer,
    a bidirectional encoder or, when `is_decoder`, a causal decoder. Images (`"image"`): the DeiT-style encoder,
    patch embedding with 2-D positions (and a class token when pooling="cls"). A family's base model
    (`Zoo<Family>Model`) is this class with the family's config, so a head's `base_model` saves and loads with
    `AutoModel` like transformers' own (`LlamaForCausalLM.model` is a `LlamaModel`)."""

    def __init__(self, config):
        # Settings given to from_pretrained(..., name=value) are set after the config checked itself: checked again
        # here, so that an unsupported one (rope_scaling={"rope_type": "dynamic"}, say) raises instead of being
        # silently ignored (found by the long-context benchmark's NTK row).
        config.validate_architecture()
        super().__init__(config)
        if config.modality == "image":
            if config.pooling == "last":
                raise ValueError("pooling='last' has no meaning for images; use 'mean' or 'cls'.")
            if config.is_decoder:
                raise ValueError("image models are encoders; set is_decoder=False.")
            self.main_input_name = "pixel_values"
            self.patch_embed = PatchEmbedding(config)
            self.transformer = ZooTransformer(config, causal=False, with_positions=False)
            self.transformer.set_image_layout((self.patch_embed.grid, self.patch_embed.grid),
                                              class_token=self.patch_embed.cls_token is not None)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
            self.transformer = ZooTransformer(config, causal=config.is_decoder)
        self.post_init()

    def get_input_embeddings(self):
        return self.patch_embed.projection if self.config.modality == "image" else self.embed_tokens

    def set_input_embeddings(self, value):
        if self.config.modality == "image":
            raise ValueError("an image model embeds patches, not token ids; it has no input embeddings to replace.")
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                cache=None, use_cache=None, output_hidden_states=None, return_dict=None, pixel_values=None,
                **kwargs):
        if self.config.modality == "image":
            given = [name for name, value in (("input_ids", input_ids), ("inputs_embeds", inputs_embeds),
                                              ("attention_mask", attention_mask)) if value is not None]
            if given:
                raise ValueError(f"{given}: this is an image model (config.modality='image'); pass pixel_values.")
            hidden, all_hidden = self.transformer(self.patch_embed(pixel_values),
                                                  output_hidden_states=output_hidden_states)
            return as_output(BaseModelOutput(last_hidden_state=hidden, hidden_states=all_hidden), return_dict,
                             self.config)
        if pixel_values is not None:
            raise ValueError("pixel_values: this is a text model (config.modality='text'); pass input_ids.")
        cache = take_cache(cache, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = embed_token_ids(self.embed_tokens, input_ids)
        if use_cache is None:  # caches serve decoding; a training forward never needs one
            use_cache = self.config.use_cache and self.config.is_decoder and not self.training
        if use_cache and not self.config.is_decoder:
            raise ValueError("use_cache=True needs a decoder; build the model with is_decoder=True.")
        if use_cache and cache is None:
            cache = ZooCache.for_transformer(self.transformer)
        output_hidden_states = output_hidden_states if output_hidden_states is not None else \
            self.config.output_hidden_states
        hidden, all_hidden = self.transformer(
            inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache if use_cache else None, output_hidden_states=output_hidden_states,
        )
        out = with_cache(BaseModelOutputWithPast, cache if use_cache else None, last_hidden_state=hidden,
                         hidden_states=all_hidden)
        return as_output(out, return_dict, self.config)


def family_base_model(head_class: type) -> type:
    """The base model a head of `head_class`'s family builds on: the family's `Zoo<Family>Model` (named by the rule
    `remote_code.family_model_classes` reads), or `ZooModel` for a head outside a family module."""
    prefix = head_class.config_class.__name__.removesuffix("Config")
    return getattr(sys.modules[head_class.__module__], prefix + "Model", ZooModel)


class ZooSeq2SeqEncoder(nn.Module):
    """The encoder half of an encoder-decoder model; owns the vocabulary embedding the decoder shares."""

    main_input_name = "input_ids"

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.transformer = ZooTransformer(config, causal=False)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = embed_token_ids(self.embed_tokens, input_ids)
        hidden, all_hidden = self.transformer(inputs_embeds, attention_mask=attention_mask,
                                              output_hidden_states=bool(output_hidden_states))
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=all_hidden)
