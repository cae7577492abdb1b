"""Registers each family's config and model classes with transformers' Auto classes."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

AUTO_CLASS_BY_HEAD = {
    "Model": AutoModel,
    "ForCausalLM": AutoModelForCausalLM,
    "ForMaskedLM": AutoModelForMaskedLM,
    "ForSequenceClassification": AutoModelForSequenceClassification,
    "ForImageClassification": AutoModelForImageClassification,
    "ForConditionalGeneration": AutoModelForSeq2SeqLM,
}


def register_family(config_class, module, prefix: str) -> None:
    """Register `config_class` and the classes `{prefix}{head}` found in `module` (exist_ok, so re-import is safe)."""
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for head, auto_class in AUTO_CLASS_BY_HEAD.items():
        auto_class.register(config_class, getattr(module, prefix + head), exist_ok=True)
