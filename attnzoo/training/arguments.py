"""Command-line arguments every training script shares (optimisation, schedule, checkpoints, precision, tracking,
Hub), and their checks. A script adds its data and model arguments, then parses with `parse_with_recipe`."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from attnzoo.registration import FAMILY_CONFIGS
from attnzoo.training.tracking import REPORT_TO_CHOICES

FAMILIES = tuple(FAMILY_CONFIGS)  # the registered families (attnzoo/__init__.py)
SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "cosine_with_restarts", "polynomial", "constant",
              "constant_with_warmup", "inverse_sqrt")


class ModelSettings(argparse.Action):
    """`--model NAME=VALUE ...`, the model settings of every script and converter; repeated flags add up. `--config`,
    the converters' older spelling, is still accepted, with a note naming `--model`."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != "--model":
            print(f"note: {option_string} is the older spelling of --model; use --model NAME=VALUE, the model-settings "
                  "flag of every attnzoo script and converter.", file=sys.stderr)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *values])


def add_model_settings_argument(group, help: str) -> None:
    """`--model NAME=VALUE ...` (and its older spelling `--config`) into `args.model`."""
    group.add_argument("--model", nargs="*", default=[], metavar="NAME=VALUE", action=ModelSettings, help=help)
    group.add_argument("--config", nargs="*", dest="model", action=ModelSettings, help=argparse.SUPPRESS)


def add_model_arguments(parser: argparse.ArgumentParser, default_family: str = "softmax") -> None:
    group = parser.add_argument_group("model")
    parser.set_defaults(default_family=default_family)
    group.add_argument("--family", default=default_family,
                       help=f"attention family of a new model: {', '.join(FAMILIES)} (model_type attnzoo_FAMILY)")
    group.add_argument("--model_name_or_path", default=None,
                       help="start from this saved folder or Hub id instead of a new model")
    add_model_settings_argument(group, "config values of a new model, e.g. hidden_size=128 attn_layers=[favor] "
                                       "reversible=true")


def add_training_arguments(parser: argparse.ArgumentParser, **defaults) -> None:
    """Optimisation, schedule, checkpointing, precision, logging and Hub arguments. `defaults` override the
    generic defaults below for one script (e.g. learning_rate=7e-4 for translation)."""
    g = parser.add_argument_group("optimisation")
    g.add_argument("--per_device_train_batch_size", type=int, default=8)
    g.add_argument("--per_device_eval_batch_size", type=int, default=8)
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--learning_rate", type=float, default=1e-3)
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--adam_beta1", type=float, default=0.9)
    g.add_argument("--adam_beta2", type=float, default=0.999)
    g.add_argument("--adam_epsilon", type=float, default=1e-8)
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: off)")
    g.add_argument("--lr_scheduler_type", default="cosine", choices=SCHEDULERS)
    g.add_argument("--num_warmup_steps", type=int, default=0)
    g.add_argument("--min_learning_rate", type=float, default=0.0,
                   help="floor of the cosine_with_min_lr schedule (DeiT: 1e-5)")
    g.add_argument("--max_train_steps", type=int, default=None,
                   help="optimizer steps (the schedule's length); default: --num_train_epochs epochs")
    g.add_argument("--num_train_epochs", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    g.add_argument("--torch_compile", action="store_true",
                   help="compile the model with torch.compile (inductor, whole graph, one graph per input shape); the "
                        "first steps then take a while to compile")
    g.add_argument("--cpu_threads", type=int, default=0,
                   help="CPU threads per process on a CPU run (0: the machine's cores split between the processes; "
                        "accelerate launch would otherwise leave one)")

    g = parser.add_argument_group("evaluation, checkpoints and logging")
    g.add_argument("--eval_steps", type=int, default=0, help="evaluate every N optimizer steps (0: only at the end)")
    g.add_argument("--max_eval_batches", type=int, default=0, help="cap evaluation batches per process (0: all)")
    g.add_argument("--logging_steps", type=int, default=25, help="log the training loss every N steps")
    g.add_argument("--checkpointing_steps", type=int, default=0, help="save the training state every N steps")
    g.add_argument("--checkpoints_total_limit", type=int, default=0, help="keep only the newest N (0: all)")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="'latest' (start fresh if the run has none yet) or an OUTPUT_DIR/checkpoints/step_N folder: "
                        "resumes only this script's own run in --output_dir, with its settings")
    g.add_argument("--output_dir", default="runs/run")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="start over in an --output_dir that holds an earlier run: delete the files that run wrote "
                        "(listed in its run_args.json) first. A folder that is not a run, or holds other files too, is "
                        "refused and left as it is (docs/training.md, Output folders)")
    g.add_argument("--report_to", default="auto", choices=REPORT_TO_CHOICES,
                   help="auto: a metrics.jsonl, plus TensorBoard when installed")

    g = parser.add_argument_group("faults (README: When things go wrong)")
    g.add_argument("--max_nonfinite_steps", type=int, default=10,
                   help="skip the update of a step whose loss or gradient norm is NaN/inf, and stop once more than N "
                        "steps were skipped (0: stop at the first)")
    g.add_argument("--max_failed_saves", type=int, default=2,
                   help="a checkpoint save that fails (e.g. a full disk) is reported and training goes on; stop when "
                        "more than N saves in a row fail (0: stop at the first)")
    g.add_argument("--skip_bad_examples", action="store_true",
                   help="skip malformed examples (bad JSON lines, missing fields, unreadable images, lines that are "
                        "not UTF-8) and report how many, instead of stopping at the first with its file and line")

    g = parser.add_argument_group("Hugging Face Hub")
    g.add_argument("--push_to_hub", action="store_true", help="upload the final model, tokenizer and model card")
    g.add_argument("--hub_model_id", default=None, help="repository id, e.g. user/attnzoo-enwik8")
    g.add_argument("--hub_token", default=None, help="default: the HF_TOKEN environment variable / cached login")
    g.add_argument("--hub_private_repo", action="store_true")
    g.add_argument("--model_card_template", default=None, help="a Jinja markdown template (default: model_cards/)")
    parser.set_defaults(**defaults)


def check_family_of_source(args: argparse.Namespace) -> None:
    """--family configures a new model; with --model_name_or_path the model has its own (its config's model_type).
    Only the family of a new model is the parser's default, so a --family that names another family than a local
    model's is a mistake the run would otherwise ignore (and record)."""
    config_file = Path(args.model_name_or_path) / "config.json"
    if not config_file.is_file():
        return  # a Hub id: its family is read when it loads
    import json

    try:
        model_type = json.loads(config_file.read_text()).get("model_type", "")
    except (ValueError, OSError, AttributeError):
        return  # transformers reports an unreadable config when it loads
    family = model_type.removeprefix("attnzoo_")
    if args.family != family and args.family != getattr(args, "default_family", None):
        raise ValueError(f"--family {args.family} configures a new model, but --model_name_or_path "
                         f"{args.model_name_or_path} is a {model_type} model: drop --family (the model keeps its "
                         "family) or convert it first.")
    args.family = family  # the run record names the family it trains


def check_training_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the argument and what to change."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set a positive integer.")
    for name in ("eval_steps", "max_eval_batches", "checkpointing_steps", "checkpoints_total_limit",
                 "num_warmup_steps"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set 0 (off) or a positive integer.")
    for name in ("max_nonfinite_steps", "max_failed_saves"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set how many to tolerate (0: stop at the "
                             "first).")
    if args.logging_steps < 1:
        raise ValueError(f"--logging_steps={args.logging_steps} is invalid: set a positive integer.")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ValueError(f"--learning_rate={args.learning_rate} is invalid: set a positive, finite value.")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set a value in [0, 1) (e.g. 0.9, 0.999).")
    if not (math.isfinite(args.adam_epsilon) and args.adam_epsilon > 0):
        raise ValueError(f"--adam_epsilon={args.adam_epsilon} is invalid: set a small positive value (e.g. 1e-8).")
    for name in ("weight_decay", "max_grad_norm"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: set a finite value >= 0.")
    if args.max_train_steps is None and args.num_train_epochs is None:
        raise ValueError("set --max_train_steps (optimizer steps) or --num_train_epochs.")
    if args.max_train_steps is not None and args.max_train_steps < 1:
        raise ValueError(f"--max_train_steps={args.max_train_steps} is invalid: set a positive integer.")
    if args.num_train_epochs is not None and not args.num_train_epochs > 0:
        raise ValueError(f"--num_train_epochs={args.num_train_epochs} is invalid: set a positive number.")
    if args.family not in FAMILIES and not args.model_name_or_path:
        raise ValueError(f"--family {args.family!r} is unknown: use one of {FAMILIES}.")
    for flag in ("train_file", "validation_file", "test_file"):
        path = getattr(args, flag, None)
        if path and Path(path).is_file() and Path(path).stat().st_size == 0:
            raise ValueError(f"--{flag} {path} is empty; pass a file with data (or leave --{flag} out).")
    if args.model_name_or_path:
        from attnzoo.training.model_source import check_model_source

        check_model_source(args.model_name_or_path)
        check_family_of_source(args)
    if args.model_name_or_path and args.model:
        raise ValueError("--model NAME=VALUE configures a new model; it cannot change --model_name_or_path "
                         f"{args.model_name_or_path}. Drop one of them.")
    if args.mixed_precision == "fp16":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--mixed_precision fp16 needs a CUDA GPU; use bf16 on CPU (or 'no').")
    if args.lr_scheduler_type == "cosine_with_min_lr" and not 0 <= args.min_learning_rate < args.learning_rate:
        raise ValueError(f"--min_learning_rate={args.min_learning_rate} must be in [0, --learning_rate).")
