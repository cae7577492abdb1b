"""What the pretrained-weight converters (`gpt2`, `vit`) share: the target family's config, the weights of each
attention layout, loading them so that nothing is left unmapped, and writing the result only once all of it worked.

A source's q, k, v and output projections are handed over per layer as (weight, bias) pairs in `nn.Linear` layout
([out_features, in_features]); `attention_weights` places them according to the attention module's own layout:
- q_proj / k_proj / v_proj / o_proj: softmax ("full"), FAVOR+ and elu+1 ("favor", "elu"), RA ("ra"), LARA ("lara");
- query / key / value / output: Reformer's local attention ("local");
- query_key / value / output: LSH attention ("lsh"), whose shared query-key projection starts as the source's query
  projection (Reformer: The Efficient Transformer, arXiv 2001.04451, §2 "shared-QK Transformer"); the source's key
  projection has no place there and is dropped (reported in `ConversionReport.dropped`).
Parameters an attention has beyond these (LARA's landmark transforms) and buffers (Performer's evaluation projection)
keep the initialisation of their module, except where `init_attention_extras` sets a better start.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from attnzoo.configuration.base import PEER_SPELLINGS
from attnzoo.registration import FAMILY_CONFIGS

logger = logging.getLogger(__name__)

FAMILIES = tuple(FAMILY_CONFIGS)  # the registered families (attnzoo/__init__.py)

#: attention layouts the converters fill: module attribute -> source projection ("q", "k", "v" or "o")
PROJECTION_LAYOUTS = (
    {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"},
    {"query_key": "q", "value": "v", "output": "o"},
    {"query": "q", "key": "k", "value": "v", "output": "o"},
)

#: settings a conversion starts from unless the user overrides them (see `build_config`). LARA's landmark transform
#: (a Linear + LayerNorm on the landmarks; "Linear Complexity Randomized Self-attention Mechanism", arXiv 2204.04667,
#: §4) is off: a softmax model has none to carry over, and without it the landmarks are segment means of the source's
#: own queries and keys, whereas even an identity-started transform's LayerNorm would rescale them.
#: `--model lara_landmark_transform=true` adds it, starting from the identity Linear (see `init_attention_extras`).
CONVERSION_DEFAULTS = {"lara": {"lara_landmark_transform": False}}


@dataclass
class ConversionReport:
    """What a conversion did besides copying: source weights left out and target parameters started fresh."""

    dropped: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = []
        if self.dropped:
            parts.append(f"{len(self.dropped)} source tensors have no place in the target and were left out "
                         f"(e.g. {self.dropped[0]})")
        if self.fresh:
            parts.append(f"{len(self.fresh)} attention parameters/buffers of the target start from their "
                         f"initialisation (e.g. {self.fresh[0]})")
        return "; ".join(parts) or "every weight mapped one to one"


def family_config_class(family: str):
    """The config class of `attnzoo_{family}`."""
    from transformers import CONFIG_MAPPING

    if family not in FAMILIES:
        raise ValueError(f"--family {family!r} is unknown; use one of {FAMILIES}.")
    return CONFIG_MAPPING[f"attnzoo_{family}"]


def build_config(family: str, fixed: dict, defaults: dict, overrides: dict | None):
    """The target config: the family's defaults, then `defaults` (source settings the user may change, such as
    dropout), then the user's `overrides`, then `fixed` (what must match the source for the converted model to
    compute the same function: sizes, activation, norms, positions, biases, a standard residual stack).
    An override of a fixed field or of a field the family does not have raises ValueError."""
    config_class = family_config_class(family)
    overrides = dict(overrides or {})
    probe = config_class()
    unknown = sorted(k for k in overrides if not hasattr(probe, PEER_SPELLINGS.get(k, k)))  # older names too
    if unknown:
        raise ValueError(f"--model {unknown}: not fields of {config_class.__name__}; check the spelling (fields are "
                         f"documented in attnzoo.{config_class.__name__}).")
    locked = sorted(k for k in overrides if k in fixed and overrides[k] != fixed[k])
    if locked:
        raise ValueError(f"--model {locked}: fixed by the source checkpoint ("
                         + ", ".join(f"{k}={fixed[k]!r}" for k in locked)
                         + "); the converted model must compute the source's function. Change attention settings "
                           "only, or fine-tune and then change the architecture.")
    values = {**CONVERSION_DEFAULTS.get(family, {}), **defaults, **overrides, **fixed}
    return config_class(**values)


def find_projection_layout(module: nn.Module) -> dict[str, str] | None:
    """The entry of `PROJECTION_LAYOUTS` that `module` has, or None (not an attention the converters fill)."""
    return next((layout for layout in PROJECTION_LAYOUTS
                 if all(isinstance(getattr(module, name, None), nn.Linear) for name in layout)), None)


def projection_layout(attn: nn.Module) -> dict[str, str]:
    """The entry of `PROJECTION_LAYOUTS` that `attn` has, or ValueError naming the attention."""
    layout = find_projection_layout(attn)
    if layout is not None:
        return layout
    raise ValueError(f"attention {getattr(attn, 'name', '?')!r} ({type(attn).__name__}) has none of the projection "
                     f"layouts the converters fill ({[list(layout) for layout in PROJECTION_LAYOUTS]}); pick "
                     "attn_layers of another kind.")


def attention_weights(attn: nn.Module, prefix: str, projections: dict[str, tuple], report: ConversionReport,
                      source_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Target tensors `{prefix}{name}.weight/.bias` for `attn`'s projections from the source's
    `projections[role] = (weight [out, in], bias [out] or None)`; a missing source bias becomes zeros. Source roles
    the layout does not use (the key projection of shared-QK attention) are listed in `report.dropped` under
    `source_names[role]`."""
    layout = projection_layout(attn)
    out = {}
    for name, role in layout.items():
        weight, bias = projections[role]
        linear = getattr(attn, name)
        if tuple(linear.weight.shape) != tuple(weight.shape):
            raise ValueError(f"{prefix}{name}.weight has shape {tuple(linear.weight.shape)} but the source's {role} "
                             f"projection has {tuple(weight.shape)}; the sizes of the configs differ.")
        out[f"{prefix}{name}.weight"] = weight
        if linear.bias is not None:
            out[f"{prefix}{name}.bias"] = bias if bias is not None else torch.zeros_like(linear.bias)
        elif bias is not None and bool(bias.ne(0).any()):
            raise ValueError(f"{prefix}{name} has no bias but the source's {role} projection has a non-zero one; "
                             "convert with attention_bias=True.")
    report.dropped.extend(source_names[role] for role in projections if role not in layout.values())
    return out


@torch.no_grad()
def init_attention_extras(model: nn.Module) -> None:
    """Start an attention's own parameters where they change the source's attention least: LARA's landmark
    transforms (Linear + LayerNorm) begin with the identity Linear (the LayerNorm keeps its unit scale and zero
    shift), so landmarks start as normalised segment means of the source's own queries and keys."""
    for module in model.modules():
        for name in ("landmark_q", "landmark_k"):
            transform = getattr(module, name, None)
            if isinstance(transform, nn.Sequential) and isinstance(transform[0], nn.Linear):
                nn.init.eye_(transform[0].weight)
                nn.init.zeros_(transform[0].bias)


def load_converted(model: nn.Module, state: dict[str, torch.Tensor], report: ConversionReport) -> None:
    """Load `state` into `model`; every target tensor must be given except an attention's own parameters and
    buffers (recorded in `report.fresh`), and every given tensor must be used."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"converted tensors with no place in {type(model).__name__}: {unexpected[:5]}")
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) if model.config.tie_word_embeddings else set()
    own = [name for name in missing if ".attn." in name and name not in tied]
    unmapped = [name for name in missing if name not in own and name not in tied]
    if unmapped:
        raise ValueError(f"no source weight for {unmapped[:5]} of {type(model).__name__}")
    report.fresh.extend(own)


def parse_overrides(pairs: list[str] | None) -> dict:
    from attnzoo.training.recipes import parse_model_overrides

    return parse_model_overrides(pairs)


def add_converter_arguments(parser: argparse.ArgumentParser) -> None:
    from attnzoo.training.arguments import add_model_settings_argument

    parser.add_argument("dst", help="output folder (must not exist or be empty); written only if everything maps")
    parser.add_argument("--family", default="softmax", choices=FAMILIES,
                        help="attention family of the converted model (softmax: the same function as the source)")
    add_model_settings_argument(parser, "attention settings of the target family, e.g. num_random_features=256 "
                                        "attn_layers=[lsh] (--config, the older spelling, still works)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the attention's own random initialisation (Performer's evaluation features)")


def check_destination(dst: str | Path) -> Path:
    """`dst` as a Path; ValueError if it is a file or a non-empty folder (checked before converting anything): a
    converter writes only a new model, into a missing or empty folder."""
    from attnzoo.training.run_dir import describe_folder

    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"DST {dst} is a file; name a new folder for the converted model.")
    if dst.is_dir() and any(dst.iterdir()):
        raise ValueError(f"DST {dst} already holds files: {describe_folder(dst)}. A converter writes only into a "
                         "missing or empty folder; nothing was written. Name a new folder.")
    return dst


def save_converted(model, dst: str | Path, companions=(), converter: str | None = None, src: str | None = None,
                   family: str | None = None) -> Path:
    """`save_pretrained` of the model and its tokenizer / image processor into a temporary sibling folder, renamed
    to `dst` at the end, so a failure leaves no half-written output. With `converter`, the folder also gets a run
    record (`attnzoo.training.run_dir`) naming the converter, the source `src` and the target `family`, so a
    training run pointed at the folder can say what it holds."""
    from attnzoo.training.run_dir import write_model_record

    dst = check_destination(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        model.save_pretrained(staging)
        for companion in companions:
            if companion is not None:
                companion.save_pretrained(staging)
        if converter is not None:
            write_model_record(staging, converter, model.config.model_type, src, family=family)
        if dst.exists():
            dst.rmdir()
        os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


@contextmanager
def seeded(seed: int):
    """The global torch RNG seeded for the block and restored afterwards: the target's random initialisation is
    reproducible and the caller's RNG stream is left alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def load_text_tokenizer(src: str):
    """SRC's tokenizer, to travel with the converted model, or None (with a warning) when SRC has none. A GGUF
    checkpoint's is built from the file's metadata (with its chat template) and saved as an ordinary tokenizer, so
    the converted folder loads with `AutoTokenizer` and tools that read only saved folders (lm-eval)."""
    from transformers import AutoTokenizer

    from attnzoo.training.model_source import gguf_checkpoint, load_gguf_tokenizer

    try:
        gguf = gguf_checkpoint(src, "SRC")
        return load_gguf_tokenizer(gguf, "SRC") if gguf is not None else AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as error:  # weights without a tokenizer beside them, or one transformers cannot build
        logger.warning("no tokenizer copied from %s: %s", src, error)
        return None


def layer_layout(config) -> str:
    """Which layers got which attention kind, e.g. "layers 0-2 favor, 3 full"."""
    runs = []  # [first layer, last layer, kind]
    for index, kind in enumerate(config.layer_attention_kinds()):
        if runs and runs[-1][2] == kind:
            runs[-1][1] = index
        else:
            runs.append([index, index, kind])
    parts = [f"{first}{f'-{last}' if last > first else ''} {kind}" for first, last, kind in runs]
    return ("layers " if len(config.layer_attention_kinds()) > 1 else "layer ") + ", ".join(parts)


def converted_summary(model, dst, report: ConversionReport) -> str:
    return (f"wrote {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters; "
            f"{layer_layout(model.config)}) to {dst}; {report.summary()}")


def text_converter_main(module_doc: str, prog: str, src_help: str, load_source, convert, argv=None) -> None:
    """The command line of a text-model converter: `prog SRC DST --family F [--model ...] [--seed N]`. DST is checked
    and the source loaded and converted before anything is written; the tokenizer travels with the model."""
    parser = argparse.ArgumentParser(prog=prog, description=module_doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=module_doc.split("\n\n", 2)[2])
    parser.add_argument("src", help=src_help)
    add_converter_arguments(parser)
    args = parser.parse_args(argv)
    check_destination(args.dst)
    overrides = parse_overrides(args.model)
    source = load_source(args.src)
    report = ConversionReport()
    model = convert(source, args.family, overrides, args.seed, report)
    save_converted(model, args.dst, [load_text_tokenizer(args.src)], converter=prog.removeprefix("python -m "),
                   src=args.src, family=args.family)
    print(converted_summary(model, args.dst, report))
