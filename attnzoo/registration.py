"""Registers each family's config and model classes with transformers' Auto classes."""

import transformers
from transformers import AutoConfig

from attnzoo.remote_code import AUTO_CLASS_BY_HEAD as AUTO_CLASS_NAME_BY_HEAD

#: head suffix (`ForCausalLM`, ...) -> the transformers Auto class that loads it
AUTO_CLASS_BY_HEAD = {head: getattr(transformers, name) for head, name in AUTO_CLASS_NAME_BY_HEAD.items()}


def register_family(config_class, module, prefix: str) -> None:
    """Register `config_class` and the classes `{prefix}{head}` found in `module` (exist_ok, so re-import is safe)."""
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for head, auto_class in AUTO_CLASS_BY_HEAD.items():
        auto_class.register(config_class, getattr(module, prefix + head), exist_ok=True)
