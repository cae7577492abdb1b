"""Every point where attnzoo depends on how transformers works inside, kept in this one module.

Each choice is made by detecting a feature of the transformers that is imported, never by comparing version
numbers: a checkpoint's remote code carries this file, so it adapts to the *user's* transformers, which may be newer
or older than the one the checkpoint was saved with. The supported range is pyproject's; CI runs its two ends.

What lives here, and why:
- **The cache's name.** transformers 5.24 renamed the cache everywhere at once, from `past_key_values` to `cache`:
  the keyword `generate()` passes to `forward`, the `ModelOutput` field it reads back, and `model_kwargs`. A forward
  that takes only the old name silently drops the cache and decodes every step from the new token alone. `CACHE_KW`
  is the name of the installed version; `take_cache` accepts any of the names in a forward, `with_cache` writes an
  output under the current one and `output_cache` reads it back.
- **The generation hooks** that hand `generate()` the model's own cache (growing, or static for
  `cache_implementation="static"`, sized from the length generate() passes its cache hook), and keep the 2-D
  padding mask that it would turn into 4-D masks for a static cache (`GenerationHooks`).
- **Activation checkpointing**: the method that enables it was renamed in 5.23 (`gradient_checkpointing_enable` to
  `activation_checkpointing_enable`; attnzoo calls it through `enable_activation_checkpointing`),
  and `GradientCheckpointingLayer` nulls a differently named cache keyword in each release, so attnzoo drops the
  cache itself while blocks are checkpointed (`drops_cache_under_checkpointing`).
- **The Trainer's inference keys** (`CACHE_NAMES`): the outputs the Trainer must not gather during evaluation.
- **Static cache slots** (`static_written_length`): a `StaticLayer` returns its whole preallocated key/value
  tensors from `update()`, unwritten slots included, and counts what was written in its `cumulative_length` tensor;
  softmax attention masks the rest by that count (no host sync, so a decode step stays capturable).
- **Config overrides** (`config_loading_options`, `loaded_for_another_loader`): `from_pretrained(path, **kwargs)`
  hands a config's `from_dict` the overrides mixed with options of transformers' loading, which it drops when they
  are not attributes of the config. attnzoo refuses a dropped keyword (a misspelt override) unless it is one of
  those options (the named parameters of the config and model loaders, detected, and what they take from
  `**kwargs`) or the config is read by another of transformers' loaders (AutoTokenizer, AutoProcessor, pipeline():
  they pass their own options, `padding_side`, `pad_token`..., through `AutoConfig.from_pretrained`).
- **`trust_remote_code`** (`trust_remote_code_given`): with attnzoo imported, transformers builds a checkpoint from
  attnzoo's registered classes rather than its carried code, and passes the flag to no class it builds; a
  checkpoint that carries a user's attention module runs that copy only when the caller trusted remote code, which
  is read from the loading calls' keyword arguments.
- **The attention implementation a model runs with** (`attention_implementation`): transformers keeps it in the
  config's private `_attn_implementation`; `set_attn_implementation` (public) switches it, and the retrieval-layer
  calibration (attnzoo.evaluation.retrieval_layers) switches it back to what it was.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from transformers import AutoConfig, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

#: every name transformers has given the cache, as a forward keyword and as an output field (current one first)
CACHE_NAMES = ("cache", "past_key_values", "cache_params")
#: cache names no supported transformers passes to a model's forward: `past_key_value` (singular) was a layer's
#: keyword in 4.x; 5.17 (the floor) and 5.24 take it nowhere (their Llama swallows it in `**kwargs` and decodes
#: without the cache). A forward refuses them: its `**kwargs` would otherwise drop the cache without a word.
MISSPELT_CACHE_NAMES = ("past_key_value",)


def _detect_cache_keyword() -> str:
    """The name under which the installed transformers passes the cache to `forward` and reads it from outputs.
    Outputs and `prepare_inputs_for_generation` were renamed together; if they ever disagree, guessing would decode
    silently wrong, so importing fails instead."""
    in_outputs = next(name for name in CACHE_NAMES[:2] if name in BaseModelOutputWithPast.__dataclass_fields__)
    passed = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    if in_outputs not in passed:
        raise ImportError(
            f"this transformers names the cache {in_outputs!r} in its outputs but "
            f"prepare_inputs_for_generation takes {[n for n in CACHE_NAMES if n in passed]}; attnzoo cannot tell "
            "which name generate() uses. Install a transformers release inside attnzoo's supported range "
            "(pyproject.toml)."
        )
    return in_outputs


#: the keyword `generate()` passes the cache under, and the output field it reads it back from
CACHE_KW = _detect_cache_keyword()


def take_cache(cache, kwargs: dict):
    """The cache a forward was given under any of its names: `cache` (the forward's own parameter), or
    `past_key_values` / `cache_params` left in its `**kwargs` (removed from them, so nothing passes them on).
    Two different caches at once are refused rather than one of them silently ignored, and so is a cache under a name
    no transformers passes (`MISSPELT_CACHE_NAMES`), which would otherwise decode from the new tokens alone."""
    for name in MISSPELT_CACHE_NAMES:
        if name in kwargs:
            raise TypeError(f"forward() got an unexpected keyword argument {name!r}, which would decode without "
                            "the cache: pass the cache as `past_key_values=` or `cache=` (either works, with any "
                            "supported transformers).")
    given = {"cache": cache} if cache is not None else {}
    for name in CACHE_NAMES[1:]:
        value = kwargs.pop(name, None)
        if value is not None:
            given[name] = value
    values = list(given.values())
    # Compared by identity with `is`: `id()` inside a compiled forward would make torch.compile guard on the cache
    # object's id, and recompile the decode step for every new cache (every generate() call).
    if any(value is not values[0] for value in values[1:]):
        raise ValueError(f"two different caches were passed ({', '.join(given)}); pass one, as `cache=`.")
    return values[0] if values else None


def with_cache(output_class, cache, **fields):
    """`output_class(**fields)` (a transformers `ModelOutput`) with `cache` under the installed version's field name.
    A missing cache is left out rather than set to None: beam search raises on a cache key whose value is None."""
    if cache is not None:
        fields[CACHE_KW] = cache
    return output_class(**fields)


def output_cache(output):
    """The cache a model output holds (None without one), whatever transformers calls the field."""
    return output.get(CACHE_KW)


def enable_activation_checkpointing(model, **kwargs) -> None:
    """Turn on activation (gradient) checkpointing: `activation_checkpointing_enable` where transformers has it
    (5.23 and later, where the older name is deprecated), `gradient_checkpointing_enable` before."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(**kwargs)


def drops_cache_under_checkpointing(blocks, training: bool) -> bool:
    """Whether a forward must run without its cache: some block recomputes its forward in the backward pass
    (activation checkpointing, set by transformers on each `GradientCheckpointingLayer` as `gradient_checkpointing`),
    which would write the cache twice. transformers' layer nulls the cache itself, but under a keyword name that
    changed between releases, so attnzoo decides here, by the same rule (training with gradients)."""
    return training and torch.is_grad_enabled() and any(getattr(b, "gradient_checkpointing", False) for b in blocks)


class GenerationHooks:
    """The `GenerationMixin` hooks through which `generate()` gets the model's own cache, mixed into every attnzoo
    model. The model provides `new_decoding_cache()`."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # Each layer's attention decides its cache slot: generate() must not build a plain DynamicCache.
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Put the model's own cache into `model_kwargs` before decoding starts, as generate() does with a
        DynamicCache for standard models, so that every decoding strategy (assisted and prompt-lookup decoding too)
        finds one. A cache the user passed, or `use_cache=False`, is left to transformers."""
        if model_kwargs.get(CACHE_KW) is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        implementation = generation_config.cache_implementation
        if implementation in (None, "dynamic"):
            model_kwargs[CACHE_KW] = self.new_decoding_cache()
        elif implementation == "static":
            length = _generation_cache_length(super()._prepare_cache_for_generation, generation_config, args, kwargs)
            model_kwargs[CACHE_KW] = self.new_decoding_cache(max_cache_len=length)
        else:
            raise ValueError(f"cache_implementation={implementation!r} is not supported by {type(self).__name__}; "
                             "leave it unset (each layer's attention picks its growing cache) or pass 'static' "
                             "(fixed-shape slots, for compiled decoding).")

    def create_masks_for_generate(self, *args, attention_mask=None, **kwargs):
        """generate() turns the 2-D padding mask into 4-D causal masks when the cache is compileable (a static
        cache), through this model-overridable hook. attnzoo's attentions build their causal, window and static-slot
        masks from the 2-D padding mask themselves, so it stays 2-D; for a static cache it is padded to the cache's
        `max_cache_len` columns (positions not written yet count as padding), so every decode step has the same
        shapes and a compiled step is not recompiled as the sequence grows."""
        cache = next((kwargs[name] for name in CACHE_NAMES[:2] if kwargs.get(name) is not None), None)
        capacity = static_capacity(cache)
        if attention_mask is None or capacity is None or attention_mask.shape[-1] >= capacity:
            return attention_mask
        return torch.nn.functional.pad(attention_mask, (0, capacity - attention_mask.shape[-1]))


def static_capacity(cache) -> int | None:
    """The positions a static (compileable) cache holds, or None: transformers' `StaticCache` and attnzoo's static
    slots both name it `max_cache_len` on every layer."""
    cache = getattr(cache, "self_attention_cache", cache)
    sizes = [getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", ())]
    return min(sizes) if sizes and None not in sizes else None


def _generation_cache_length(prepare_cache, generation_config, args, kwargs) -> int:
    """The positions a static cache needs for this generate() call: the `max_cache_length` that generate() passes
    its cache hook (prompt plus new tokens), read by name from the installed release's signature, or the
    generation's `max_length` where it passes none; at least `generation_config.max_cache_len` where that is set (a
    ceiling shared by several calls, so they reuse one compiled step)."""
    try:
        passed = inspect.signature(prepare_cache).bind(generation_config, {}, *args, **kwargs).arguments
    except TypeError:
        passed = {}
    length = passed.get("max_cache_length") or generation_config.max_length
    ceiling = getattr(generation_config, "max_cache_len", None)
    if ceiling is None:
        return length
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or ceiling < 1:
        raise ValueError(f"max_cache_len={ceiling!r} is invalid: pass the number of positions the static cache must "
                         "hold (a positive int, at least prompt plus new tokens), or leave it unset (generate() "
                         "then sizes the cache for this call).")
    return max(length, ceiling)


def static_written_length(slot) -> torch.Tensor | None:
    """For a preallocated (static) cache slot after `update()`: the number of key positions written so far, a tensor
    on the slot's device; None for any other slot (its keys are exactly the written ones)."""
    written = getattr(slot, "cumulative_length", None)
    if isinstance(written, torch.Tensor) and getattr(slot, "max_cache_len", None) is not None:
        return written
    return None


# -- config loading ----------------------------------------------------------------------------------------------------
#: what transformers' loaders take from `**kwargs` (5.17 to 5.24) besides their named parameters: options that may
#: reach a config's `from_dict` without being settings. The model loader's are here too: code that shares one dict
#: of keyword arguments between `AutoConfig.from_pretrained` and `AutoModel*.from_pretrained` passes them to both.
_LOADING_OPTIONS = (
    # the config loaders (PreTrainedConfig.from_pretrained / get_config_dict, AutoConfig) and the Auto classes
    "proxies", "subfolder", "trust_remote_code", "code_revision", "gguf_file", "return_unused_kwargs",
    "adapter_kwargs", "name_or_path",
    # PreTrainedModel.from_pretrained
    "state_dict", "tqdm_class", "output_loading_info", "dtype", "torch_dtype", "device_map", "max_memory",
    "offload_folder", "offload_buffers", "quantization_config", "variant", "adapter_name", "generation_config",
    "distributed_config", "device_mesh", "tp_plan", "tp_size", "allow_all_kernels", "use_kernels", "kernel_config",
    "key_mapping", "attn_implementation", "experts_implementation",
    # ... and what it still accepts and ignores
    "mirror", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict",
)


@functools.cache
def config_loading_options() -> frozenset[str]:
    """Keyword arguments of transformers' loading that are not config settings: the named parameters of
    `PreTrainedConfig.from_pretrained` and `PreTrainedModel.from_pretrained` in the installed release, and
    `_LOADING_OPTIONS`."""
    named = set()
    for method in (PreTrainedConfig.from_pretrained, PreTrainedModel.from_pretrained):
        named |= {name for name, parameter in inspect.signature(method).parameters.items()
                  if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)}
    return frozenset(named | set(_LOADING_OPTIONS))


def loaded_for_another_loader(skip_modules=()) -> bool:
    """Whether the config being loaded is read by another of transformers' loaders rather than for the caller's own
    use: the first caller up the stack outside transformers' config loading (the modules of `PreTrainedConfig` and
    `AutoConfig`) and outside `skip_modules` is transformers code. AutoTokenizer, AutoProcessor, AutoImageProcessor,
    AutoFeatureExtractor and pipeline() read the model's config this way, passing their own keyword arguments
    through `AutoConfig.from_pretrained`, which ignores what is not a config attribute."""
    loading = {PreTrainedConfig.__module__, AutoConfig.__module__, __name__, *skip_modules}
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "") in loading:
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("transformers.")


def trust_remote_code_given() -> bool:
    """Whether the `from_pretrained` call building the current model was given trust_remote_code=True. transformers
    hands the flag to no class it builds, so it is read from the keyword arguments of the `from_pretrained` calls
    up the stack (an Auto class passes its resolved value on to the model class's). Where no such call is found
    (a transformers that passes the flag otherwise), the answer is False: the loader then names the module to
    import instead of running the checkpoint's copy."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "from_pretrained":
            arguments = inspect.getargvalues(frame)
            keywords = arguments.locals.get(arguments.keywords) if arguments.keywords else None
            if isinstance(keywords, dict) and "trust_remote_code" in keywords:
                return bool(keywords["trust_remote_code"])
        frame = frame.f_back
    return False


def attention_implementation(model) -> str:
    """The attention implementation a transformers model runs with ("sdpa", "eager", a registered name), so that a
    caller that switches it with the public `set_attn_implementation` can switch it back."""
    return model.config._attn_implementation
