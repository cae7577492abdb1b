"""Convert a timm ViT or (non-distilled) DeiT into any attnzoo family's `ForImageClassification`.

    python -m attnzoo.convert.vit SRC DST --family lara [--model lara_num_samples=49 ...] [--timm_model NAME]

SRC is a timm model name (`deit_small_patch16_224`, with timm's pretrained weights), a Hub id
(`timm/vit_base_patch16_224.augreg_in21k_ft_in1k`), a folder saved by timm (`config.json` + weights, read through
timm's `local-dir:`) or a checkpoint file together with `--timm_model NAME`. DST receives the attnzoo model and an
image processor with the source's evaluation transform (resize to size / crop_pct, centre crop, its mean and std),
so `AutoModelForImageClassification`, `AutoImageProcessor` and `pipeline("image-classification")` load it; label
names come from the source (ImageNet class names when it is an ImageNet classifier).

timm's standard ViT is the zoo's image backbone: a convolutional patch embedding with bias, a class token, a learned
position table over [class token, patches], pre-LayerNorm blocks with the erf GELU, a final LayerNorm and a linear
head on the class token. With `--family softmax` the converted model computes the same logits (float64: to 1e-10);
other families get every shared weight and their attention settings from `--model` (layouts and starting values:
`attnzoo.convert.common`; Reformer's layer pattern: `attnzoo.convert.gpt2`).

Variants that compute something else raise ValueError naming the option: distilled DeiT (a distillation token and
a second head), global_pool other than "token" (mean pooling with fc_norm, attention pooling), no class token,
register tokens, no_embed_class, pre_norm, no final norm, LayerScale (init_values), qk_norm, scale_attn_norm /
scale_mlp_norm, gated attention, a patch-embedding norm, dynamic image sizes, patch dropout, other block, MLP or
activation types, non-square images or patches, and any weight the mapping does not know.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch import nn

from attnzoo.convert.common import (
    ConversionReport,
    add_converter_arguments,
    attention_weights,
    build_config,
    check_destination,
    converted_summary,
    init_attention_extras,
    load_converted,
    parse_overrides,
    save_converted,
    seeded,
)

logger = logging.getLogger(__name__)

#: timm interpolation names -> PIL resampling codes (the image processor's `resample`)
PIL_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1, "box": 4, "hamming": 5}


def _is_identity(module) -> bool:
    return module is None or isinstance(module, nn.Identity)


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, list | tuple) else (value, value)


def _activation(act: nn.Module) -> str | None:
    """The zoo's name for timm's MLP activation, or None when the zoo has no exact equivalent."""
    if type(act) is nn.GELU:
        return "gelu" if act.approximate == "none" else "gelu_new"  # gelu_new is the same tanh formula
    return {nn.ReLU: "relu", nn.SiLU: "silu", nn.Tanh: "tanh"}.get(type(act))


def unsupported_options(model) -> list[str]:
    """Every option of a timm model that the zoo's image backbone does not compute (empty: it converts)."""
    from timm.layers import Attention, Mlp, PatchEmbed
    from timm.models.vision_transformer import Block, VisionTransformer

    if getattr(model, "dist_token", None) is not None or hasattr(model, "head_dist"):
        return ["a distilled DeiT (dist_token and head_dist: a second token and head averaged into the logits); "
                "convert the non-distilled deit_*_patch16_224"]
    if not isinstance(model, VisionTransformer):
        return [f"{type(model).__name__} (only timm's VisionTransformer converts)"]
    problems = []

    def check(ok: bool, option: str):
        if not ok:
            problems.append(option)

    check(model.global_pool == "token" and model.attn_pool is None,
          f"global_pool={model.global_pool!r} (the zoo classifies from the class token: global_pool='token')")
    check(model.has_class_token, "class_token=False")
    check(getattr(model, "num_reg_tokens", 0) == 0, f"reg_tokens={getattr(model, 'num_reg_tokens', 0)}")
    check(not model.no_embed_class, "no_embed_class=True (the zoo's position table covers the class token)")
    check(model.pos_embed is not None, "pos_embed other than 'learn'")
    check(not model.dynamic_img_size, "dynamic_img_size=True (the zoo's image size is fixed)")
    check(_is_identity(model.norm_pre), "pre_norm=True")
    check(isinstance(model.norm, nn.LayerNorm), "final_norm=False or a norm other than LayerNorm")
    check(_is_identity(model.fc_norm), "fc_norm (a norm after pooling)")
    check(_is_identity(model.patch_drop), "patch_drop_rate > 0")
    check(isinstance(model.head, nn.Linear), "num_classes=0 (no classifier head to convert)")
    embed = model.patch_embed
    if isinstance(embed, PatchEmbed) and isinstance(embed.proj, nn.Conv2d):
        check(_is_identity(embed.norm), "embed_norm_layer (a norm inside the patch embedding)")
        check(embed.proj.kernel_size == embed.proj.stride and embed.proj.padding in ((0, 0), "valid"),
              "a patch embedding whose kernel differs from its stride")
        check(len(set(_pair(embed.img_size))) == 1, f"img_size={embed.img_size} (not square)")
        check(len(set(_pair(embed.patch_size))) == 1, f"patch_size={embed.patch_size} (not square)")
        check(getattr(embed, "dynamic_img_pad", False) is False, "dynamic_img_pad=True")
    else:
        problems.append(f"embed_layer={type(embed).__name__} (the zoo has a plain convolutional patch embedding)")
    first = getattr(model.blocks[0], "norm1", None) if len(model.blocks) else None
    eps = first.eps if isinstance(first, nn.LayerNorm) else None  # the zoo has one layer_norm_eps for all norms
    if isinstance(model.norm, nn.LayerNorm) and eps is not None and model.norm.eps != eps:
        problems.append(f"a final norm eps ({model.norm.eps}) other than the blocks' ({eps})")
    for i, block in enumerate(model.blocks):
        if type(block) is not Block:
            problems.append(f"blocks.{i} is a {type(block).__name__} (block_fn other than timm's Block)")
            continue
        attn, mlp = block.attn, block.mlp
        for name, ok in (("init_values (LayerScale)", _is_identity(block.ls1) and _is_identity(block.ls2)),
                         ("norm_layer other than LayerNorm, or norms with different eps",
                          all(isinstance(n, nn.LayerNorm) and n.eps == eps for n in (block.norm1, block.norm2))),
                         ("attn_layer other than timm's Attention", type(attn) is Attention),
                         ("mlp_layer other than timm's Mlp", type(mlp) is Mlp)):
            if not ok and name not in problems:
                problems.append(name)
        if type(attn) is Attention:
            for name, ok in (("qk_norm=True", _is_identity(attn.q_norm) and _is_identity(attn.k_norm)),
                             ("scale_attn_norm=True", _is_identity(attn.norm)),
                             ("gated attention", getattr(attn, "gate", None) is None),
                             ("attn_head_dim other than embed_dim / num_heads",
                              attn.num_heads * attn.head_dim == model.embed_dim),
                             ("attention scale other than head_dim ** -0.5", attn.scale == attn.head_dim ** -0.5)):
                if not ok and name not in problems:
                    problems.append(name)
        if type(mlp) is Mlp:
            if not _is_identity(mlp.norm) and "scale_mlp_norm=True" not in problems:
                problems.append("scale_mlp_norm=True")
            if _activation(mlp.act) is None and "act_layer" not in " ".join(problems):
                problems.append(f"act_layer={type(mlp.act).__name__} (the zoo has gelu, gelu_new, relu, silu, tanh)")
    return problems


def check_source(model) -> None:
    problems = unsupported_options(model)
    if problems:
        name = getattr(model, "pretrained_cfg", {}).get("architecture", type(model).__name__)
        raise ValueError(f"{name} does not map to the attnzoo image backbone: " + "; ".join(problems) + ".")


def label_names(model) -> dict[int, str] | None:
    """id -> name from the source: timm's label names for ImageNet subsets (available offline), its
    pretrained_cfg's `label_names`, or None."""
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    names = cfg.get("label_names")
    if names and len(names) == model.num_classes:
        return dict(enumerate(names))
    try:
        from timm.data import ImageNetInfo, infer_imagenet_subset
    except ImportError:
        return None
    subset = infer_imagenet_subset(model)
    if subset is None:
        return None
    info = ImageNetInfo(subset)
    if info.num_classes() != model.num_classes:
        return None
    return {i: info.index_to_description(i) for i in range(model.num_classes)}


def target_config(model, family: str, overrides: dict | None = None):
    """The attnzoo config of `family` whose image backbone computes what the timm `model` computes."""
    check_source(model)
    block = model.blocks[0]
    fixed = dict(hidden_size=model.embed_dim, num_hidden_layers=len(model.blocks),
                 num_attention_heads=block.attn.num_heads, intermediate_size=block.mlp.fc1.out_features,
                 hidden_act=_activation(block.mlp.act), layer_norm_eps=model.norm.eps, attention_bias=True,
                 position_embedding_type="learned", reversible=False, is_decoder=False, pooling="cls",
                 image_size=_pair(model.patch_embed.img_size)[0], patch_size=_pair(model.patch_embed.patch_size)[0],
                 num_channels=model.patch_embed.proj.in_channels, num_labels=model.num_classes,
                 # the blocks' sequence length; LSH attention sizes its default bucket count from it
                 max_position_embeddings=model.patch_embed.num_patches + model.num_prefix_tokens)
    if family == "reformer":
        fixed["attention_head_size"] = None
    labels = label_names(model)
    defaults = dict(hidden_dropout_prob=block.attn.proj_drop.p, attention_probs_dropout_prob=block.attn.attn_drop.p,
                    classifier_dropout=model.head_drop.p,
                    drop_path_rate=float(getattr(model.blocks[-1].drop_path1, "drop_prob", 0.0) or 0.0))
    if labels is not None:
        defaults.update(id2label=labels, label2id={name: i for i, name in labels.items()})
    return build_config(family, fixed, defaults, overrides)


def convert_state_dict(state: dict[str, torch.Tensor], model, target, report: ConversionReport) -> dict:
    """The attnzoo tensors of `target` from a timm VisionTransformer state dict; ValueError naming any source key
    left unmapped."""
    remaining = dict(state)

    def take(name: str) -> torch.Tensor:
        if name not in remaining:
            raise ValueError(f"the source has no {name!r}; it is not a complete VisionTransformer checkpoint.")
        return remaining.pop(name)

    def linear(name: str):
        return take(f"{name}.weight"), remaining.pop(f"{name}.bias", None)

    dim = model.embed_dim
    patch = "model.patch_embed."
    weight, bias = linear("patch_embed.proj")
    out = {patch + "projection.weight": weight,
           patch + "projection.bias": bias if bias is not None else weight.new_zeros(weight.shape[0]),
           patch + "cls_token": take("cls_token"), patch + "position_embeddings": take("pos_embed")}
    for i, block in enumerate(target.model.transformer.blocks):
        src, dst = f"blocks.{i}.", f"model.transformer.blocks.{i}."
        out[dst + "attn_norm.weight"], out[dst + "attn_norm.bias"] = linear(src + "norm1")
        qkv_weight, qkv_bias = linear(src + "attn.qkv")
        weights = qkv_weight.split(dim, dim=0)
        biases = qkv_bias.split(dim) if qkv_bias is not None else (None, None, None)
        projections = {role: (weights[j], biases[j]) for j, role in enumerate("qkv")}
        projections["o"] = linear(src + "attn.proj")
        names = {role: f"{src}attn.qkv ({role} part)" for role in "qkv"}
        out.update(attention_weights(block.attn, dst + "attn.", projections, report, names))
        out[dst + "ffn_norm.weight"], out[dst + "ffn_norm.bias"] = linear(src + "norm2")
        out[dst + "ffn.fc_in.weight"], out[dst + "ffn.fc_in.bias"] = linear(src + "mlp.fc1")
        out[dst + "ffn.fc_out.weight"], out[dst + "ffn.fc_out.bias"] = linear(src + "mlp.fc2")
    out["model.transformer.final_norm.weight"], out["model.transformer.final_norm.bias"] = linear("norm")
    out["head.classifier.weight"], out["head.classifier.bias"] = linear("head")
    for name in ("model.transformer.final_norm.bias", "head.classifier.bias", *[k for k in out if k.endswith(
            ("ffn.fc_in.bias", "ffn.fc_out.bias", "norm.bias"))]):
        if out[name] is None:
            raise ValueError(f"the source has no bias for {name}; the zoo's layers all have one.")
    if remaining:
        raise ValueError(f"source weights the ViT mapping does not know: {sorted(remaining)[:5]}; nothing was "
                         "converted.")
    return out


def convert(source, family: str = "softmax", overrides: dict | None = None, seed: int = 0, report=None):
    """An attnzoo `ForImageClassification` of `family` with the weights of the timm VisionTransformer `source`, in
    its dtype and training mode. `overrides`: attention settings of the family's config."""
    from transformers import AutoModelForImageClassification

    report = report if report is not None else ConversionReport()
    config = target_config(source, family, overrides)
    with seeded(seed):
        model = AutoModelForImageClassification.from_config(config)
    model.to(next(source.parameters()).dtype)
    init_attention_extras(model)
    load_converted(model, convert_state_dict(source.state_dict(), source, model, report), report)
    return model.train(source.training)


def image_processor(source):
    """An image processor with the source's evaluation transform (timm's data config): resize the shorter side to
    size / crop_pct, centre-crop to size, normalise with its mean and std. `AutoImageProcessor` loads it."""
    from timm.data import resolve_data_config
    from transformers import ConvNextImageProcessor

    data = resolve_data_config({}, model=source)
    if data.get("crop_mode", "center") != "center":
        raise ValueError(f"crop_mode={data['crop_mode']!r}: only timm's 'center' evaluation crop has an image "
                         "processor equivalent here.")
    size = data["input_size"][-1]
    return ConvNextImageProcessor(size={"shortest_edge": size}, crop_pct=data["crop_pct"],
                                  resample=PIL_RESAMPLE.get(data["interpolation"], 3),
                                  image_mean=list(data["mean"]), image_std=list(data["std"]))


def load_source(src: str, timm_model: str | None = None):
    """A timm model with pretrained weights, in eval mode: a model name or Hub id, a folder timm saved, or a
    checkpoint file with `timm_model` naming its architecture."""
    import timm

    path = Path(src)
    if path.is_file():
        if not timm_model:
            raise ValueError(f"{src} is a checkpoint file; pass --timm_model NAME (e.g. deit_small_patch16_224) to "
                             "say which architecture it holds.")
        # The head's size comes from the file, so a fine-tuned checkpoint keeps its classifier (timm drops a
        # classifier whose size differs from the pretrained config's).
        head = timm.models.load_state_dict(str(path)).get("head.weight")
        overlay = dict(file=str(path), **({"num_classes": head.shape[0]} if head is not None else {}))
        try:
            model = timm.create_model(timm_model, pretrained=True, pretrained_cfg_overlay=overlay,
                                      **({"num_classes": head.shape[0]} if head is not None else {}))
        except RuntimeError as error:  # timm's strict load: the file holds another architecture
            raise ValueError(f"the weights in {src} do not fit timm's {timm_model}; pass the --timm_model they were "
                             f"saved from. timm says: {str(error)[:300]}") from error
    elif path.is_dir():
        model = timm.create_model(f"local-dir:{path}", pretrained=True)
    else:
        if src.startswith((".", "/", "~")) or len(path.parts) > 2 or path.suffix:
            raise ValueError(f"SRC {src}: no such file or folder. Pass a timm model name (e.g. "
                             "deit_small_patch16_224), a Hub id, a folder timm saved, or a weights file with "
                             "--timm_model.")
        name = src if src.startswith("hf-hub:") or "/" not in src else f"hf-hub:{src}"
        model = timm.create_model(timm_model or name, pretrained=True)
    return model.eval()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m attnzoo.convert.vit", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("src", help="timm model name, Hub id, timm folder or checkpoint file")
    add_converter_arguments(parser)
    parser.add_argument("--timm_model", default=None,
                        help="the timm architecture of a checkpoint file (e.g. deit_small_patch16_224)")
    args = parser.parse_args(argv)
    check_destination(args.dst)
    overrides = parse_overrides(args.model)
    source = load_source(args.src, args.timm_model)
    report = ConversionReport()
    model = convert(source, args.family, overrides, args.seed, report)
    save_converted(model, args.dst, [image_processor(source)], converter="attnzoo.convert.vit", src=args.src,
                   family=args.family)
    print(converted_summary(model, args.dst, report))


if __name__ == "__main__":
    main()
