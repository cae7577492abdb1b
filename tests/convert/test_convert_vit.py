"""timm ViT / DeiT -> attnzoo ForImageClassification: exact softmax equality, every family converting, saving and
classifying through the Auto classes and pipeline("image-classification"), the swap error falling as the
approximation gets finer, and variants that do not map failing clearly. Sources have random weights (no network)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")

from PIL import Image  # noqa: E402
from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline  # noqa: E402

import attnzoo  # noqa: E402, F401
from attnzoo.convert import vit  # noqa: E402
from attnzoo.convert.common import FAMILIES, ConversionReport  # noqa: E402

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)
FAMILY_OPTIONS = {"softmax": {}, "performer": {"num_random_features": 32}, "ra": {},
                  "lara": {"lara_num_samples": 4}, "reformer": {"lsh_chunk_length": 8, "local_chunk_length": 8},
                  "hybrid": {"num_random_features": 32}, "window": {"window_size": 8, "num_sink_tokens": 2}}


def tiny_vit(name="vit_tiny_patch16_224", seed=0, peaked=1.0, dtype=torch.float64, **overrides):
    """A timm model with random weights; `peaked` scales the query and key weights (attention far from uniform)."""
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **{**TINY, **overrides}).to(dtype).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:2 * model.embed_dim] *= peaked
    return model


def pixels(batch=2, size=16, seed=1):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(scope="module")
def saved_source(tmp_path_factory):
    """A folder in timm's own format (config.json + weights), read through `local-dir:`."""
    folder = tmp_path_factory.mktemp("vit_source")
    from timm.models import _hub

    _hub.save_for_hf(tiny_vit(peaked=3.0, dtype=torch.float32), str(folder))
    # Hub checkpoints of non-default sizes carry the sizes as `model_args` and the input size in `pretrained_cfg`;
    # timm writes both itself from 1.0.31 on, older releases the defaults of the architecture (224 pixels)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("model_args", TINY)
    config["pretrained_cfg"]["input_size"] = [3, TINY["img_size"], TINY["img_size"]]
    config_file.write_text(json.dumps(config))
    return folder


# -- exact softmax conversion ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_patch16_224"])
def test_softmax_conversion_gives_the_source_logits_float64(name):
    source = tiny_vit(name, peaked=3.0)
    model = vit.convert(source, "softmax")
    assert type(model).__name__ == "ZooSoftmaxForImageClassification"
    assert model.config.pooling == "cls" and model.config.layer_norm_eps == 1e-6 and model.config.hidden_act == "gelu"
    x = pixels()
    with torch.no_grad():
        assert (model(pixel_values=x).logits - source(x)).abs().max().item() < 1e-10


def test_no_qkv_bias_converts_with_zero_biases():
    source = tiny_vit(qkv_bias=False, peaked=3.0)
    model = vit.convert(source, "softmax")
    x = pixels()
    with torch.no_grad():
        assert (model(pixel_values=x).logits - source(x)).abs().max().item() < 1e-10
    assert model.model.transformer.blocks[0].attn.q_proj.bias.abs().sum() == 0


# -- every family ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_converts_saves_reloads_and_classifies(family, saved_source, tmp_path):
    dst = tmp_path / family
    options = [f"{k}={v}" for k, v in FAMILY_OPTIONS[family].items()]
    vit.main([str(saved_source), str(dst), "--family", family, "--model", *options])
    model = AutoModelForImageClassification.from_pretrained(dst).eval()
    assert model.config.model_type == f"attnzoo_{family}" and model.config.num_labels == 5
    source = timm.create_model(f"local-dir:{saved_source}", pretrained=True).eval()
    # every shared weight carried over
    embed = model.model.patch_embed
    assert torch.equal(embed.projection.weight, source.patch_embed.proj.weight)
    assert torch.equal(embed.position_embeddings, source.pos_embed) and torch.equal(embed.cls_token, source.cls_token)
    block, source_block = model.model.transformer.blocks[1], source.blocks[1]
    assert torch.equal(block.ffn.fc_out.weight, source_block.mlp.fc2.weight)
    attn_query = getattr(block.attn, "q_proj", None) or getattr(block.attn, "query_key", None)
    assert torch.equal(attn_query.weight, source_block.attn.qkv.weight[:32])
    assert torch.equal(model.head.classifier.weight, source.head.weight)
    # the image processor is the source's evaluation transform
    processor = AutoImageProcessor.from_pretrained(dst)
    data = timm.data.resolve_data_config({}, model=source)
    assert processor.size["shortest_edge"] == 16 and processor.crop_pct == data["crop_pct"]
    assert list(processor.image_mean) == list(data["mean"]) and list(processor.image_std) == list(data["std"])
    image = Image.fromarray((np.random.default_rng(0).random((20, 24, 3)) * 255).astype("uint8"))
    predictions = pipeline("image-classification", model=str(dst), top_k=3)(image)
    assert len(predictions) == 3 and all(p["label"].startswith("LABEL_") for p in predictions)


def test_checkpoint_file_with_timm_model_name_and_imagenet_labels(tmp_path):
    """A plain weights file needs --timm_model; ImageNet classifiers get the ImageNet class names (offline)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    save_file(source.state_dict(), tmp_path / "deit.safetensors")
    with pytest.raises(ValueError, match="pass --timm_model"):
        vit.main([str(tmp_path / "deit.safetensors"), str(tmp_path / "out"), "--family", "performer"])
    with pytest.raises(ValueError, match="do not fit timm's deit_small_patch16_224"):
        vit.main([str(tmp_path / "deit.safetensors"), str(tmp_path / "out"), "--timm_model", "deit_small_patch16_224"])
    vit.main([str(tmp_path / "deit.safetensors"), str(tmp_path / "out"), "--family", "softmax",
              "--timm_model", "deit_tiny_patch16_224", "--model", "hidden_dropout_prob=0.0"])
    model = AutoModelForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert model.config.id2label[0] == "tench, Tinca tinca" and model.config.num_hidden_layers == 12
    processor = AutoImageProcessor.from_pretrained(tmp_path / "out")
    assert processor.crop_pct == 0.9 and list(processor.image_std) == [0.229, 0.224, 0.225]


def test_reformer_conversion_shares_query_key_and_reports_the_dropped_key():
    report = ConversionReport()
    model = vit.convert(tiny_vit(), "reformer", {"attn_layers": ["lsh"]}, report=report)
    assert model.config.attn_layers == ["lsh"] and not model.config.reversible
    assert report.dropped == ["blocks.0.attn.qkv (k part)", "blocks.1.attn.qkv (k part)"]


# -- fidelity of the swap -------------------------------------------------------------------------------------
def relative_error(source, model, x, forward_seed) -> float:
    with torch.no_grad():
        reference = source(x)
        torch.manual_seed(forward_seed)
        out = model(pixel_values=x).logits
    return ((out - reference).pow(2).mean() / (reference - reference.mean(-1, keepdim=True)).pow(2).mean()).item()


@pytest.mark.parametrize("family, field, values, fixed, ratio", [
    ("performer", "num_random_features", (8, 512), {}, 0.8),
    ("ra", "ra_num_samples", (1, 16), {}, 0.5),
    ("lara", "lara_num_samples", (4, 17), {}, 0.8),  # 17 = one landmark per token (class token + 16 patches)
    # The chunk window: in the default bucket window the class token (far from every patch) hashes alone in every
    # round and attends to itself, so the pooled logits cannot move with the rounds.
    ("reformer", "lsh_num_hashes", (1, 8), {"attn_layers": ["lsh"], "lsh_chunk_length": 4, "lsh_attend_to": "chunk",
                                            "lsh_full_attention_threshold": 0}, 0.8),
])
def test_swap_error_falls_as_the_approximation_gets_finer(family, field, values, fixed, ratio):
    source = tiny_vit(peaked=4.0)
    x = pixels(batch=4)
    seeds = range(3) if family != "lara" else range(1)  # LARA evaluates deterministically (omega = mu)

    def error(value):
        models = [vit.convert(source, family, {field: value, **fixed}, seed=s).eval() for s in seeds]
        errors = [relative_error(source, model, x, 10 + s) for s, model in zip(seeds, models, strict=True)]
        return sum(errors) / len(errors)

    errors = [error(value) for value in values]
    assert all(finer < ratio * coarser for coarser, finer in zip(errors, errors[1:], strict=False)), errors


# -- what does not map ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    (dict(global_pool="avg"), "global_pool='avg'"),
    (dict(init_values=1e-5), r"init_values \(LayerScale\)"),
    (dict(qk_norm=True), "qk_norm=True"),
    (dict(reg_tokens=4), "reg_tokens=4"),
    (dict(no_embed_class=True), "no_embed_class=True"),
    (dict(class_token=False, global_pool="avg"), "class_token=False"),
    (dict(dynamic_img_size=True), "dynamic_img_size=True"),
    (dict(pre_norm=True), "pre_norm=True"),
])
def test_unsupported_vit_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        vit.convert(tiny_vit(**options), "softmax")


def test_distilled_deit_is_rejected():
    distilled = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, **TINY)
    with pytest.raises(ValueError, match="distilled DeiT"):
        vit.convert(distilled, "lara")


def test_unknown_source_key_is_named_and_nothing_is_written(tmp_path):
    source = tiny_vit()
    source.blocks[1].attn.temperature = nn.Parameter(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.temperature"):
        vit.convert(source, "performer")
    with pytest.raises(ValueError, match="fixed by the source checkpoint"):
        vit.convert(tiny_vit(), "lara", {"pooling": "mean"})
    assert not list(tmp_path.iterdir())


# -- fine-tuning end to end -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_fine_tuning_a_converted_vit_keeps_its_size_and_normalisation(saved_source, tmp_path):
    """train_image_classification.py --model_name_or_path on a converted timm ViT: the image size, mean/std and crop
    come from the checkpoint (vit_tiny's 0.5/0.5, crop 0.9), the head is replaced for the new labels."""
    from tests.scripts_helpers import QUIET, run_script, write_image_folders

    images = write_image_folders(tmp_path / "glyphs", image_size=16, per_class=6, validation=2)
    converted, out = tmp_path / "lara", tmp_path / "run"
    vit.main([str(saved_source), str(converted), "--family", "lara", "--model", "lara_num_samples=4"])
    accuracy = run_script("train_image_classification", [
        "--model_name_or_path", converted, "--train_dir", images / "train", "--validation_dir",
        images / "validation", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
        "--max_train_steps", "3", "--num_warmup_steps", "1", "--output_dir", out, *QUIET])
    model = AutoModelForImageClassification.from_pretrained(out)
    assert model.config.model_type == "attnzoo_lara" and model.config.num_labels == 10
    processor = AutoImageProcessor.from_pretrained(out)
    assert processor.size["shortest_edge"] == 16 and processor.crop_pct == 0.9
    assert list(processor.image_mean) == [0.5] * 3 and list(processor.image_std) == [0.5] * 3
    evaluated = run_script("evaluate", ["--model_name_or_path", out])
    assert evaluated["top1_accuracy"] == pytest.approx(accuracy)
