"""Overrides given to `from_pretrained` are checked as constructor arguments, in every family (issue 45): a bad value
raises the constructor's ValueError naming the field, an unknown keyword is refused naming the closest setting, and
nothing on disk changes; what transformers' conventions pass through a config's loading (hub and model-loading
options, `return_unused_kwargs=True`, the options of AutoTokenizer) still works."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import attnzoo  # noqa: F401  (registers the Auto classes)
from attnzoo.registration import FAMILY_CONFIGS
from attnzoo.tokenization import byte_level_tokenizer
from tests.scripts_helpers import FAMILIES

SIZES = dict(vocab_size=259, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64, pad_token_id=256, bos_token_id=257, eos_token_id=258, is_decoder=True)
SMALL = {"reformer": dict(lsh_chunk_length=8, local_chunk_length=8), "performer": dict(num_random_features=16)}

#: the overrides of the issue, each accepted before and saved into a folder that no longer loaded
BAD_OVERRIDES = [("window_size", -1), ("num_sink_tokens", -2), ("sink_positions", "bogus"),
                 ("far_positions", ["bogus"]), ("far_query_scale_length", 0), ("attn_layers", ["bogus"]),
                 ("hidden_size", 31)]


def fields_of(family: str) -> set[str]:
    return {field.name for field in dataclasses.fields(FAMILY_CONFIGS[family])}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> a folder holding a tiny causal LM of that family, saved with save_pretrained, and a tokenizer."""
    folders = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        config = AutoConfig.for_model(f"attnzoo_{family}", **SIZES, **SMALL.get(family, {}))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        byte_level_tokenizer(64).save_pretrained(folder)
        folders[family] = folder
    return folders


@pytest.fixture
def checkpoint(checkpoints, request):
    """The family's folder, asserted unchanged byte for byte at the end of the test."""
    folder = checkpoints[request.node.callspec.params["family"]]
    before = snapshot(folder)
    yield folder
    assert snapshot(folder) == before, "loading with overrides changed the checkpoint's files"


# -- bad values ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key, value", BAD_OVERRIDES, ids=[key for key, _ in BAD_OVERRIDES])
def test_a_bad_override_is_refused_naming_the_field(family, key, value, checkpoint):
    """AutoConfig.from_pretrained, the family's config class and from_dict all refuse it: with the constructor's
    message where the family has the setting, as another family's setting where it does not."""
    expected = "is invalid" if key in fields_of(family) else f"is not a setting of {FAMILY_CONFIGS[family].__name__}"
    for load in (lambda: AutoConfig.from_pretrained(checkpoint, **{key: value}),
                 lambda: FAMILY_CONFIGS[family].from_pretrained(checkpoint, **{key: value}),
                 lambda: FAMILY_CONFIGS[family].from_dict(json.loads((checkpoint / "config.json").read_text()),
                                                          **{key: value})):
        with pytest.raises(ValueError) as refused:
            load()
        assert f"{key}={value!r}" in str(refused.value) and expected in str(refused.value), str(refused.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_values_are_refused_through_the_model_loader_too(family, checkpoint):
    for key, value in BAD_OVERRIDES:
        if key in fields_of(family):
            with pytest.raises(ValueError, match=re.escape(f"{key}={value!r}")):
                AutoModelForCausalLM.from_pretrained(checkpoint, **{key: value})


def test_the_constructors_messages_say_what_to_change(checkpoints):
    """The messages a user sees for the issue's window model."""
    folder = checkpoints["window"]
    expected = {
        "window_size": "window_size=-1 is invalid: set a positive integer.",
        "num_sink_tokens": "num_sink_tokens=-2 is invalid: set a non-negative integer (0 = a plain sliding window).",
        "sink_positions": "sink_positions='bogus' is invalid: use one of ('absolute', 'adjacent').",
        "far_positions": "far_positions=['bogus'] is invalid: list one of ['rotary', 'none', 'fixed', 'grouped'] "
                         "per layer",
        "far_query_scale_length": "far_query_scale_length=0 is invalid: set a positive integer.",
        "attn_layers": "attn_layers=['bogus'] is invalid: unknown attention 'bogus'; known kinds: [",
        "hidden_size": "num_attention_heads=2 is invalid: it must divide hidden_size=31; pick a divisor or change "
                       "hidden_size.",
    }
    for key, value in BAD_OVERRIDES:
        with pytest.raises(ValueError) as refused:
            AutoConfig.from_pretrained(folder, **{key: value})
        assert str(refused.value).startswith(expected[key]), str(refused.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_attention_kind_must_be_registered_and_fit_the_family(family, checkpoint):
    with pytest.raises(ValueError, match=r"decoder_attn_layers=\['full', 'bogus'\] is invalid: unknown attention "
                                         r"'bogus'"):
        AutoConfig.from_pretrained(checkpoint, decoder_attn_layers=["full", "bogus"])
    if "lsh_num_hashes" not in fields_of(family):  # the Reformer's attention, where the family lacks its settings
        with pytest.raises(ValueError, match=r"attn_layers=\['lsh'\] is invalid: attention 'lsh' reads the settings "
                                             r"of ZooReformerSettings, which .* does not have; build the model with "
                                             r"a config that has them: ZooHybridConfig, ZooReformerConfig\."):
            AutoConfig.from_pretrained(checkpoint, attn_layers=["lsh"])


# -- unknown names ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_a_misspelt_override_is_refused_naming_the_setting(family, checkpoint):
    name = FAMILY_CONFIGS[family].__name__
    with pytest.raises(ValueError, match=rf"hiden_size=8 is not a setting of {name}; did you mean 'hidden_size'\?"):
        AutoConfig.from_pretrained(checkpoint, hiden_size=8)
    with pytest.raises(ValueError, match=rf"windw_size=8 is not a setting of {name}"
                                         + ("; did you mean 'window_size'" if "window_size" in fields_of(family)
                                            else "")):
        AutoConfig.from_pretrained(checkpoint, windw_size=8)
    with pytest.raises(ValueError, match=rf"windw_size=8 is not a setting of {name}"):
        FAMILY_CONFIGS[family].from_dict(json.loads((checkpoint / "config.json").read_text()), windw_size=8)
    with pytest.raises(ValueError, match=rf"head_dim=8 is not a setting of {name}: head_dim is derived"):
        AutoConfig.from_pretrained(checkpoint, head_dim=8)


def test_the_issues_misspelling_suggests_window_size(checkpoints):
    with pytest.raises(ValueError) as refused:
        AutoConfig.from_pretrained(checkpoints["window"], windw_size=8)
    assert str(refused.value) == "windw_size=8 is not a setting of ZooWindowConfig; did you mean 'window_size'?"
    with pytest.raises(ValueError) as refused:
        AutoConfig.from_pretrained(checkpoints["window"], lsh_num_hashes_eval=8)
    assert str(refused.value) == ("lsh_num_hashes_eval=8 is not a setting of ZooWindowConfig; it is one of "
                                  "ZooHybridConfig, ZooReformerConfig: build the model with one of those.")


ALL_FIELDS = set().union(*(fields_of(other) for other in FAMILIES))


# the hybrid family has every family's settings: no other family's setting exists to refuse
@pytest.mark.parametrize("family", [f for f in FAMILIES if ALL_FIELDS - fields_of(f)])
def test_another_familys_setting_is_refused(family, checkpoint):
    foreign = sorted(ALL_FIELDS - fields_of(family))
    with pytest.raises(ValueError, match=rf"{foreign[0]}=8 is not a setting of {FAMILY_CONFIGS[family].__name__}; "
                                         r"it is one of .*: build the model with one of those\."):
        AutoConfig.from_pretrained(checkpoint, **{foreign[0]: 8})
    if "lsh_num_hashes" not in fields_of(family):  # transformers' Reformer's name for a setting the family lacks
        with pytest.raises(ValueError, match=r"num_hashes=4: num_hashes is another name for lsh_num_hashes, which"):
            AutoConfig.from_pretrained(checkpoint, num_hashes=4)


# -- what still works ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_valid_overrides_are_applied_and_saved(family, checkpoint, tmp_path):
    overrides = dict(initializer_range=0.5, use_cache=False, feed_forward_size=96, attn_layers=["full"])
    if "window_size" in fields_of(family):
        overrides.update(window_size=8, num_sink_tokens=2)
    if "lsh_num_hashes" in fields_of(family):
        overrides.update(num_hashes=3)  # transformers' Reformer's name, over the saved lsh_num_hashes
    config = AutoConfig.from_pretrained(checkpoint, **overrides)
    expected = {"intermediate_size" if key == "feed_forward_size" else "lsh_num_hashes" if key == "num_hashes"
                else key: value for key, value in overrides.items()}
    assert {key: getattr(config, key) for key in expected} == expected
    assert type(config) is FAMILY_CONFIGS[family]
    config.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert {key: getattr(again, key) for key in expected} == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loading_options_are_still_accepted(family, checkpoint, tmp_path):
    """Hub options, the Auto classes' and pipelines' internal keywords, and model-loading options from a dict of
    keyword arguments shared with the model loader: none is a setting, none is refused."""
    options = dict(cache_dir=str(tmp_path), force_download=False, local_files_only=True, token=None, revision="main",
                   proxies=None, subfolder="", code_revision=None, _from_auto=True, _from_pipeline="text-generation",
                   gguf_file=None, device_map="cpu", dtype=torch.float64, attn_implementation="eager",
                   low_cpu_mem_usage=True, output_loading_info=False, use_safetensors=True)
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True, **options)
    assert type(config) is FAMILY_CONFIGS[family] and config.dtype == torch.float64
    config = FAMILY_CONFIGS[family].from_pretrained(checkpoint, **options)
    assert config.dtype == torch.float64


@pytest.mark.parametrize("family", FAMILIES)
def test_unused_keywords_are_returned_when_asked_for(family, checkpoint):
    """`return_unused_kwargs=True` (what the model loaders pass) gives back what is not a setting, misspellings
    included, as transformers does; settings among the keywords are applied and checked."""
    config, unused = AutoConfig.from_pretrained(checkpoint, return_unused_kwargs=True, foo=1, windw_size=8,
                                                device_map="cpu", initializer_range=0.5)
    assert unused == {"foo": 1, "windw_size": 8, "device_map": "cpu"} and config.initializer_range == 0.5
    saved = json.loads((checkpoint / "config.json").read_text())
    config, unused = FAMILY_CONFIGS[family].from_dict(saved, return_unused_kwargs=True, foo=1, use_cache=False)
    assert unused == {"foo": 1} and config.use_cache is False
    with pytest.raises(ValueError, match=r"far_query_scale_length=0 is invalid: set a positive integer\."):
        AutoConfig.from_pretrained(checkpoint, return_unused_kwargs=True, far_query_scale_length=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_loader_takes_dtype_and_overrides(family, checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    assert model.dtype == torch.float64 and type(model.config) is FAMILY_CONFIGS[family]
    override = dict(window_size=8) if "window_size" in fields_of(family) else dict(initializer_range=0.5)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64, device_map="cpu", **override)
    assert model.dtype == torch.float64 and all(getattr(model.config, k) == v for k, v in override.items())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    # a keyword the model does not take ends in the model class's own error, as with transformers' models
    with pytest.raises(TypeError, match="windw_size"):
        AutoModelForCausalLM.from_pretrained(checkpoint, windw_size=8)


def test_the_tokenizers_own_options_pass_through_the_config(checkpoints, caplog):
    """AutoTokenizer.from_pretrained reads the model's config through AutoConfig.from_pretrained with its own keyword
    arguments; they are the tokenizer's, and reach it (no refusal, which transformers would swallow by loading a
    bare PreTrainedConfig instead)."""
    with caplog.at_level(logging.INFO, logger="attnzoo.configuration.base"):
        tokenizer = AutoTokenizer.from_pretrained(checkpoints["window"], padding_side="left", model_max_length=32)
    assert tokenizer.padding_side == "left" and tokenizer.model_max_length == 32
    assert "ZooWindowConfig leaves padding_side, model_max_length to the loader that reads it" in caplog.text


# -- a checkpoint's remote code --------------------------------------------------------------------------------------
def test_overrides_are_checked_by_a_checkpoints_remote_code(checkpoints, tmp_path):
    """Where attnzoo is not installed, the code a checkpoint carries checks overrides the same way, and a config it
    loaded with a valid override saves a folder that loads."""
    folder = checkpoints["window"]
    before = snapshot(folder)
    script = f"""
import json, sys
sys.modules["attnzoo"] = None  # as if attnzoo were not installed
from transformers import AutoConfig, AutoModelForCausalLM
folder, out = {str(folder)!r}, {str(tmp_path / "saved")!r}
errors = {{}}
for key, value in [("window_size", -1), ("windw_size", 8), ("lsh_num_hashes_eval", 8)]:
    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=True, **{{key: value}})
    except ValueError as error:
        errors[key] = str(error)
config = AutoConfig.from_pretrained(folder, trust_remote_code=True, window_size=8)
assert "attnzoo" not in type(config).__module__, type(config).__module__
config.save_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, window_size=8)
try:  # the copy of the config's code does not see the registry of the model's: the model's construction refuses it
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_layers=["bogus"])
except ValueError as error:
    errors["attn_layers"] = str(error)
print(json.dumps({{"errors": errors, "saved": AutoConfig.from_pretrained(out, trust_remote_code=True).window_size,
                  "model": model.config.window_size}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["saved"] == 8 and result["model"] == 8
    errors = result["errors"]
    assert errors["window_size"] == "window_size=-1 is invalid: set a positive integer."
    assert errors["windw_size"] == "windw_size=8 is not a setting of ZooWindowConfig; did you mean 'window_size'?"
    # the checkpoint carries no other family's config, so its code cannot name the family that has the setting
    assert errors["lsh_num_hashes_eval"].startswith("lsh_num_hashes_eval=8 is not a setting of ZooWindowConfig")
    assert errors["attn_layers"].startswith("attn_layers=['bogus'] is invalid: unknown attention 'bogus'")
    assert snapshot(folder) == before
