"""Registers each family's config and model classes with transformers' Auto classes."""

import transformers
from transformers import AutoConfig

from attnzoo.remote_code import AUTO_CLASS_BY_HEAD as AUTO_CLASS_NAME_BY_HEAD

#: head suffix (`ForCausalLM`, ...) -> the transformers Auto class that loads it
AUTO_CLASS_BY_HEAD = {head: getattr(transformers, name) for head, name in AUTO_CLASS_NAME_BY_HEAD.items()}


#: family name (`softmax`, ...: the model_type without "attnzoo_") -> its config class, in registration order; the
#: scripts' and converters' `--family` choices come from here
FAMILY_CONFIGS: dict[str, type] = {}


def register_family(config_class, module) -> None:
    """Register `config_class` and its family's classes `{prefix}{head}` found in `module` (prefix: the config class
    name without "Config"), exist_ok, so re-import is safe."""
    prefix = config_class.__name__.removesuffix("Config")
    FAMILY_CONFIGS[config_class.model_type.removeprefix("attnzoo_")] = config_class
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for head, auto_class in AUTO_CLASS_BY_HEAD.items():
        auto_class.register(config_class, getattr(module, prefix + head), exist_ok=True)
