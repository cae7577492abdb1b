"""LoRA fine-tuning ("LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685) through `peft`, the
second stage of linearizing a pretrained model ("LoLCATs", arXiv 2410.10254: r=8, alpha=16 on the q, k, v and output
projections, after attention transfer): the pretrained weights stay frozen and low-rank updates of the chosen
linear layers train; at the end the updates are merged into the weights (`merge_and_unload`), so the saved model is a
plain attnzoo checkpoint that loads without peft.

peft is an optional dependency (`pip install 'attnzoo[peft]'`); it is imported only when LoRA is asked for.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from torch import nn

from attnzoo.training.checkpoints import list_checkpoints
from attnzoo.training.run_dir import RUN_ARGS_FILE, record_outputs

PEFT_INSTALL = "pip install 'attnzoo[peft]'"
#: the settings a resumed LoRA run must share with the run it continues (kept beside run_dir's RUN_ARGS_FILE)
LORA_ARGS_FILE = "lora_args.json"
LORA_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(f"LoRA (needs peft: {PEFT_INSTALL})")
    group.add_argument("--lora_r", type=int, default=None,
                       help="fine-tune rank-r LoRA adapters instead of every weight, merged into the weights at the "
                            "end (LoLCATs: 8); default: full fine-tuning")
    group.add_argument("--lora_alpha", type=float, default=None,
                       help="LoRA scaling alpha (the update is scaled by alpha / r; default: 2 * r, LoLCATs' 16 for "
                            "r=8)")
    group.add_argument("--lora_dropout", type=float, default=None, help="dropout on the LoRA input (default: 0)")
    group.add_argument("--lora_target_modules", default=None,
                       help="comma-separated names of the linear layers to adapt, e.g. q_proj,k_proj,v_proj,o_proj "
                            "(default: every attention's projections: q_proj,k_proj,v_proj,o_proj; Reformer local "
                            "attention query,key,value,output; LSH query_key,value,output)")


def lora_enabled(args) -> bool:
    return getattr(args, "lora_r", None) is not None


def check_lora_arguments(args) -> None:
    """ValueError naming the argument: a LoRA setting without --lora_r, a rank, alpha or dropout out of range,
    LoRA on a new model; ImportError naming the install command when peft is missing."""
    if not lora_enabled(args):
        given = [name for name in LORA_SETTINGS[1:] if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0]} configures LoRA, which --lora_r turns on; add --lora_r (e.g. 8) or drop "
                             f"--{given[0]}.")
        return
    if args.lora_r < 1:
        raise ValueError(f"--lora_r={args.lora_r} is invalid: set a positive rank (e.g. 8), or drop it for full "
                         "fine-tuning.")
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        raise ValueError(f"--lora_alpha={args.lora_alpha} is invalid: set a positive value (e.g. 16).")
    if args.lora_dropout is not None and not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora_dropout={args.lora_dropout} is invalid: set a value in [0, 1).")
    if args.lora_target_modules is not None and not target_names(args.lora_target_modules):
        raise ValueError("--lora_target_modules is empty; name linear layers, e.g. q_proj,k_proj,v_proj,o_proj.")
    if not args.model_name_or_path:
        raise ValueError("--lora_r adapts a pretrained model: pass --model_name_or_path (a converted or trained "
                         "checkpoint). A new model starts from random weights, which LoRA would keep frozen.")
    require_peft()


def require_peft():
    """The peft package, or ImportError saying how to install it."""
    try:
        import peft
    except ImportError as error:
        raise ImportError(f"--lora_r needs the peft package, which is not installed: {PEFT_INSTALL}") from error
    return peft


def target_names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def default_target_names(model: nn.Module) -> list[str]:
    """The projection names of every attention module in `model` that are linear layers there (each attention
    class lists its own in `projection_names`: local attention has query/key/value/output, LSH query_key/value/
    output), in first-seen order."""
    from attnzoo.modeling.attention import ZooAttention

    names: list[str] = []
    for module in model.modules():
        if isinstance(module, ZooAttention):
            for name in type(module).projection_names:
                if isinstance(getattr(module, name, None), nn.Linear) and name not in names:
                    names.append(name)
    if not names:
        raise ValueError(f"{type(model).__name__} has no attnzoo attention projections to adapt; name the linear "
                         "layers with --lora_target_modules.")
    return names


def resolve_target_modules(model: nn.Module, names: list[str]) -> list[str]:
    """The full names of the `nn.Linear` modules of `model` whose own name (the last part) is in `names`; every
    name must match at least one (ValueError listing the linear layer names there are)."""
    linear = [(full, full.rsplit(".", 1)[-1]) for full, module in model.named_modules()
              if isinstance(module, nn.Linear)]
    unmatched = [name for name in names if not any(short == name for _, short in linear)]
    if unmatched:
        available = sorted({short for _, short in linear})
        raise ValueError(f"--lora_target_modules {unmatched}: no linear layer of {type(model).__name__} has that "
                         f"name; its linear layers are named {available}.")
    return [full for full, short in linear if short in names]


def add_lora(model: nn.Module, args):
    """`model` wrapped in peft's `LoraModel`, with LoRA adapters on the target modules; only the adapters train.

    The tuner itself rather than `get_peft_model`: its `PeftModel` wrapper adds nothing a training loop that merges
    at the end needs, and it reads the model's `is_gradient_checkpointing`, which transformers 5 deprecates (a
    FutureWarning on every call)."""
    peft = require_peft()
    names = target_names(args.lora_target_modules) if args.lora_target_modules else default_target_names(model)
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha if args.lora_alpha is not None
                             else 2 * args.lora_r, lora_dropout=args.lora_dropout or 0.0,
                             target_modules=resolve_target_modules(model, names), bias="none")
    return peft.LoraModel(model, config, "default")


def merge_lora(model: nn.Module) -> nn.Module:
    """The base model with the LoRA updates merged into its weights (peft's wrappers removed)."""
    return model.merge_and_unload()


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_resumed_lora(args) -> None:
    """A resumed run must have the LoRA settings of the run it continues (the checkpoint's adapter weights fit only
    its own rank and targets; alpha and dropout change what the steps compute). Called before anything is written."""
    folder = Path(args.output_dir)
    if not args.resume_from_checkpoint or not folder.is_dir():
        return
    saved_file = folder / LORA_ARGS_FILE
    if saved_file.is_file():
        saved = json.loads(saved_file.read_text())
    elif list_checkpoints(folder) and (folder / RUN_ARGS_FILE).is_file():
        saved = dict.fromkeys(LORA_SETTINGS)  # a run without LoRA (it writes no settings file)
    else:
        return  # nothing to resume (the run starts afresh), or a run from before the settings were recorded
    current = {name: getattr(args, name) for name in LORA_SETTINGS}
    changed = [name for name in LORA_SETTINGS if saved.get(name) != current[name]]
    if changed:
        details = "; ".join(f"--{name} {current[name]!r} (the run in {folder} used {saved.get(name)!r})"
                            for name in changed)
        raise ValueError(f"cannot resume with different settings: {details}. A checkpoint continues only the run it "
                         "was saved from: resume with the run's own settings, or start a new run with another "
                         "--output_dir.")


def record_lora_settings(accelerator, args) -> None:
    """Write the LoRA settings beside the run's other settings (main process; after the output folder is set up)."""
    if accelerator.is_main_process and lora_enabled(args):
        path = Path(args.output_dir) / LORA_ARGS_FILE
        path.write_text(json.dumps({name: getattr(args, name) for name in LORA_SETTINGS}, indent=2))
        record_outputs(args.output_dir, [LORA_ARGS_FILE])
    accelerator.wait_for_everyone()
