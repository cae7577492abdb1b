"""Attention transfer, stage 1 of turning a pretrained softmax Transformer into an efficient-attention one: train
only the converted model's own attention parameters (a learned FAVOR+ projection, LARA's landmark transforms) so that
every layer's attention output matches the source model's on the same input; all other weights stay as converted.

    python -m attnzoo.convert.llama SRC converted --family performer --model feature_redraw=learned
    accelerate launch scripts/transfer_attention.py --teacher SRC --student converted --output_dir transferred
    accelerate launch scripts/train_lm.py --model_name_or_path transferred --lora_r 8 --lora_alpha 16 ...

The teacher is the source (a transformers Llama-like or GPT-2 checkpoint, or an attnzoo one), the student the
converted attnzoo model; they must share the tokenizer and the layer count. The loss is the mean over layers of the
MSE between the student's and the teacher's attention outputs ("Hedgehog & the Porcupine", arXiv 2402.04347;
"LoLCATs", arXiv 2410.10254, whose learning rate 1e-2 is the default). Data, checkpoints (--checkpointing_steps,
--resume_from_checkpoint latest), fault handling and --output_dir rules are those of train_lm.py; a checkpoint holds
only the trained parameters and their optimizer state. OUTPUT_DIR gets the whole student with the trained
parameters (float32, with its model code: AutoModelForCausalLM.from_pretrained, also with trust_remote_code), its
tokenizer, and all_results.json with the per-layer and mean transfer loss on held-out text before and after.

A student whose attention has nothing of its own to learn (softmax, RA, LSH, local, elu+1; FAVOR+ without
feature_redraw=learned; LARA without lara_landmark_transform) is not an error: the script says so, writes nothing
and exits with status 0; fine-tune it with train_lm.py directly (docs/attention_transfer.md).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import attnzoo  # noqa: F401  (registers the families with the Auto classes)
from attnzoo.tokenization import NUM_BYTES, is_byte_level
from attnzoo.training.arguments import add_training_arguments, check_training_arguments
from attnzoo.training.attention_transfer import AttentionTransfer, evaluate_transfer, find_attention_layers
from attnzoo.training.loop import (
    RunningMean,
    build_accelerator,
    eval_loader,
    log_and_checkpoint,
    prepare_run,
    progress_bar,
    save_final_model,
    train_batches,
    train_loader,
    training_record,
    training_step,
)
from attnzoo.training.model_source import check_model_source, reading_model_source
from attnzoo.training.plots import plot_curves
from attnzoo.training.publish import ARGS_FILE, RESULTS_FILE, write_json
from attnzoo.training.recipes import parse_with_recipe
from attnzoo.training.run_dir import record_outputs
from attnzoo.training.text_data import (
    PASSKEY_FRACTION_HELP,
    PASSKEY_MIN_DISTANCE_HELP,
    TokenBlocks,
    check_passkey_options,
    count_passkey_blocks,
    load_text_splits,
    with_passkey_blocks,
)
from attnzoo.training.tracking import METRICS_FILE

#: the settings a resumed transfer run must share with the run it continues, beyond run_dir.RESUME_FIXED (which
#: covers the data and the seed): the two models
TRANSFER_ARGS_FILE = "transfer_args.json"
TRANSFER_FIXED = ("teacher", "student", "teacher_dtype", "passkey_fraction")
TEACHER_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: shared training arguments this script has no use for: a transferred model is an intermediate, published after
#: fine-tuning (train_lm.py has these options)
NOT_SUPPORTED = {"push_to_hub": False, "hub_model_id": None, "hub_token": None, "hub_private_repo": False,
                 "model_card_template": None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_argument_group("models")
    models.add_argument("--teacher", required=True,
                        help="the source model: a transformers Llama-like or GPT-2 checkpoint, or an attnzoo one "
                             "(folder or Hub id)")
    models.add_argument("--student", required=True,
                        help="the attnzoo model converted from the teacher (python -m attnzoo.convert.llama/gpt2)")
    models.add_argument("--teacher_dtype", default="auto", choices=list(TEACHER_DTYPES),
                        help="precision the teacher runs in (auto: its checkpoint's); the student trains in float32")
    data = parser.add_argument_group("data (as train_lm.py --corpus text)")
    data.add_argument("--train_file", default=None,
                      help="a .txt/.json/.csv file (default: the English text that ships with CPython)")
    data.add_argument("--validation_file", default=None)
    data.add_argument("--dataset_name", default=None, help="a `datasets` dataset")
    data.add_argument("--dataset_config_name", default=None)
    data.add_argument("--text_column", default="text")
    data.add_argument("--heldout_fraction", type=float, default=0.05,
                      help="text without a validation split: hold out this final fraction")
    data.add_argument("--block_size", type=int, default=256, help="tokens per sequence")
    data.add_argument("--train_stride", type=int, default=0,
                      help="start a training block every N tokens (0: block_size, no overlap)")
    data.add_argument("--passkey_fraction", type=float, default=0.0, help=PASSKEY_FRACTION_HELP)
    data.add_argument("--passkey_min_distance", type=int, default=0, help=PASSKEY_MIN_DISTANCE_HELP)
    add_training_arguments(parser, per_device_train_batch_size=8, per_device_eval_batch_size=8, learning_rate=1e-2,
                           weight_decay=0.0, num_warmup_steps=0, max_train_steps=200, output_dir="runs/transfer")
    return parser


def check_arguments(args) -> None:
    # The shared checks also read a new model's --family/--model and --model_name_or_path, which this script does
    # not have; its two models are checked below under their own flags.
    check_training_arguments(argparse.Namespace(**{**vars(args), "family": "softmax", "model": [],
                                                   "model_name_or_path": None}))
    for name, default in NOT_SUPPORTED.items():
        if getattr(args, name) != default:
            raise ValueError(f"--{name}: the transfer script does not publish; the transferred model is an "
                             "intermediate step. Fine-tune it with scripts/train_lm.py --model_name_or_path "
                             "OUTPUT_DIR, which uploads with --push_to_hub.")
    if args.torch_compile:
        raise ValueError("--torch_compile: the transfer stops the teacher's forward after the last layer it needs, "
                         "which a whole-graph compile cannot trace; drop the flag.")
    if args.train_stride < 0:
        raise ValueError(f"--train_stride={args.train_stride} is invalid: set 0 (= block_size) or a positive stride.")
    # (no answer weight here: the transfer loss matches attention outputs at every position, not next tokens)
    check_passkey_options(args.passkey_fraction, args.passkey_min_distance, args.block_size)
    check_model_source(args.teacher, "--teacher")
    check_model_source(args.student, "--student")


def check_resumed_models(args) -> None:
    """A resumed run must use the models of the run it continues (the checkpoint holds only trained parameters,
    which fit any student of the same shape)."""
    saved_file = Path(args.output_dir) / TRANSFER_ARGS_FILE
    if not args.resume_from_checkpoint or not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text())
    changed = [name for name in TRANSFER_FIXED if name in saved and saved[name] != getattr(args, name)]
    if changed:
        details = "; ".join(f"--{name} {getattr(args, name)!r} (the run in {args.output_dir} used {saved[name]!r})"
                            for name in changed)
        raise ValueError(f"cannot resume with different settings: {details}. Resume with the run's own settings, or "
                         "start a new run with another --output_dir.")


def student_kinds(student: str) -> tuple[list[str], list[bool]]:
    """(attention kind, whether it has own parameters) per layer of the student, from its config alone (the model
    is built on the meta device: no weights are read or allocated)."""
    with reading_model_source(student, "--student"):
        config = AutoConfig.from_pretrained(student)
    if not str(config.model_type).startswith("attnzoo_"):
        raise ValueError(f"--student {student} is a {config.model_type!r} model, not an attnzoo one; convert it first "
                         "(python -m attnzoo.convert.llama / attnzoo.convert.gpt2 SRC DST --family ...) and pass DST.")
    if not any(a.endswith("ForCausalLM") for a in (config.architectures or [])):
        raise ValueError(f"--student {student} is a {config.architectures} checkpoint; attention transfer trains a "
                         "causal language model (converted from a ...ForCausalLM).")
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config)
    attentions = find_attention_layers(probe, "--student")
    return [a.name for a in attentions], [bool(a.own_parameters()) for a in attentions]


def nothing_to_learn_message(student: str, kinds: list[str]) -> str:
    return (f"--student {student}: no attention layer has parameters of its own (layers: {kinds}), so attention "
            "transfer has nothing to train. Softmax, RA, LSH, local and elu+1 attention, FAVOR+ without "
            "feature_redraw=learned and LARA without lara_landmark_transform are set entirely by the q/k/v "
            "projections the conversion carried over. Nothing was written. Go straight to fine-tuning:\n"
            f"    accelerate launch scripts/train_lm.py --model_name_or_path {student} --lora_r 8 --lora_alpha 16 "
            "--output_dir ...   (or without --lora_r: full fine-tuning)\n"
            "To transfer attention, convert with --model feature_redraw=learned (performer, hybrid) or "
            "lara_landmark_transform=true (lara, hybrid).")


def load_tokenizer(args):
    """The student's tokenizer (the teacher's when the student folder has none), after checking that both
    tokenizers, where present, are the same vocabulary: the teacher must read the ids the student is fed."""
    def attempt(name):
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError):  # a checkpoint without tokenizer files
            return None

    teacher, student = attempt(args.teacher), attempt(args.student)
    if teacher is None and student is None:
        raise ValueError(f"neither --teacher {args.teacher} nor --student {args.student} holds a tokenizer; save the "
                         "source's tokenizer beside one of them (the converters copy it).")
    if teacher is not None and student is not None:
        if len(teacher) != len(student):
            raise ValueError(f"the tokenizers differ: --teacher {args.teacher} has {len(teacher)} tokens, --student "
                             f"{args.student} {len(student)}. The student must be converted from this teacher (the "
                             "converters copy its tokenizer).")
        if teacher.get_vocab() != student.get_vocab():
            raise ValueError(f"the tokenizers of --teacher {args.teacher} and --student {args.student} both have "
                             f"{len(teacher)} tokens but map them to different ids; the student must be converted "
                             "from this teacher.")
    return student if student is not None else teacher


def load_models(args, tokenizer):
    with reading_model_source(args.teacher, "--teacher"):
        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=TEACHER_DTYPES[args.teacher_dtype])
    # float32 master weights for the trained parameters; --mixed_precision runs the forward in bf16/fp16
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    sizes = {"--teacher": teacher.config.vocab_size, "--student": student.config.vocab_size}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the vocabularies differ: {sizes} (vocab_size); the student must be converted from this "
                         "teacher.")
    # Byte-level text is fed as raw bytes (as train_lm.py does): models with 256 ids read it, whatever specials
    # the tokenizer adds on top.
    needed = NUM_BYTES if is_byte_level(tokenizer) else len(tokenizer)
    if needed > student.config.vocab_size:
        raise ValueError(f"the tokenizer has {needed} tokens the data can use but the models' vocab_size is "
                         f"{student.config.vocab_size}; the tokenizer does not belong to these models.")
    for flag, model in (("--teacher", teacher), ("--student", student)):
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None and positions < args.block_size:
            raise ValueError(f"--block_size={args.block_size} exceeds {flag}'s max_position_embeddings={positions}; "
                             "lower --block_size.")
    return teacher, student


def main(argv=None):
    args = parse_with_recipe(build_parser(), argv)
    check_arguments(args)
    kinds, learns = student_kinds(args.student)
    if not any(learns):
        if int(os.environ.get("RANK", "0")) == 0:  # once per launch (no Accelerator exists yet to ask)
            print(nothing_to_learn_message(args.student, kinds))
        return {"nothing_to_learn": True, "layer_kinds": kinds}
    check_resumed_models(args)
    accelerator = build_accelerator(args, "transfer_attention")
    set_seed(args.seed)
    tokenizer, train_set, heldout_set = build_data(args, accelerator)
    teacher, student = load_models(args, tokenizer)
    transfer = AttentionTransfer(teacher, student)
    # Neither model is a submodule of the transfer (accelerate moves only the trained parameters): place them here.
    teacher.to(accelerator.device)
    student.to(accelerator.device)
    heldout_loader = eval_loader(heldout_set, args.per_device_eval_batch_size, accelerator)
    before = evaluate_on(accelerator, args, transfer, heldout_loader)  # the converted student's (also on resume)
    run = prepare_run(accelerator, args, transfer, train_loader(train_set, args.per_device_train_batch_size,
                                                                args.seed), "transfer_attention",
                      trained_model=student, started_from=args.student)
    record_transfer_settings(accelerator, args)
    skipped = [i for i in range(len(kinds)) if i not in transfer.layers]
    accelerator.print(f"transferring layers {list(transfer.layers)} ({transfer.num_trained_parameters:,} trained "
                      f"parameters); layers {skipped} have nothing of their own to learn. {len(train_set)} training "
                      f"sequences of {args.block_size} tokens, {len(heldout_set)} held-out, {run.max_steps} steps, "
                      f"{accelerator.num_processes} process(es)")
    step, seconds = train(accelerator, args, run, transfer, heldout_loader)
    after = evaluate_on(accelerator, args, transfer, heldout_loader)
    results = {
        "teacher": args.teacher, "student": args.student, "layer_kinds": kinds,
        "transferred_layers": list(transfer.layers), "skipped_layers": skipped,
        "transfer_loss_before": sum(before) / len(before), "transfer_loss_after": sum(after) / len(after),
        "per_layer_transfer_loss_before": {str(i): v for i, v in zip(transfer.layers, before, strict=True)},
        "per_layer_transfer_loss_after": {str(i): v for i, v in zip(transfer.layers, after, strict=True)},
        "train_steps": step, "num_trained_parameters": transfer.num_trained_parameters,
        "num_train_sequences": len(train_set), "num_heldout_sequences": len(heldout_set),
        "num_passkey_sequences": count_passkey_blocks(train_set),
        "sequence_length": args.block_size, "train_seconds": seconds, "num_processes": accelerator.num_processes,
    }
    save_results(accelerator, args, student, tokenizer, results, step)
    accelerator.end_training()
    return results


def build_data(args, accelerator):
    """The tokenizer (both models read its ids) and the training and held-out blocks (with passkey sequences)."""
    tokenizer = load_tokenizer(args)
    with accelerator.main_process_first():  # `datasets` caches are built once
        train_tokens, heldout_tokens = load_text_splits(args, tokenizer, is_byte_level(tokenizer))
    train_set = with_passkey_blocks(TokenBlocks(train_tokens, args.block_size, args.train_stride or args.block_size),
                                    args.passkey_fraction, tokenizer, args.block_size, args.seed,
                                    args.passkey_min_distance)
    return tokenizer, train_set, TokenBlocks(heldout_tokens, args.block_size)


def evaluate_on(accelerator, args, transfer, heldout_loader) -> list[float]:
    """The held-out transfer loss of each transferred layer."""
    with accelerator.autocast():
        return evaluate_transfer(transfer, heldout_loader, accelerator, args.max_eval_batches)


def record_transfer_settings(accelerator, args) -> None:
    """The two models beside the run's record (after prepare_run, which empties a folder --overwrite_output_dir
    reuses): a resumed transfer must keep them."""
    if accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        write_json(output_dir / TRANSFER_ARGS_FILE, {name: getattr(args, name) for name in TRANSFER_FIXED})
        record_outputs(output_dir, [TRANSFER_ARGS_FILE])


def train(accelerator, args, run, transfer, heldout_loader) -> tuple[int, float]:
    """The transfer loop from the run's start step: (the last step, seconds spent)."""
    model, step = run.model, run.start_step
    progress = progress_bar(accelerator, run.max_steps, step, desc="transfer")
    train_loss = RunningMean()
    started = run.guard.start_clock()
    model.train()
    for batch in run.guard.watch(train_batches(accelerator, run.loader, step)) if step < run.max_steps else ():
        loss = training_step(accelerator, model, run.optimizer, run.scheduler, args.max_grad_norm,
                             lambda b=batch: model(b["input_ids"], b.get("attention_mask")).loss, run.guard)
        train_loss.add(loss)
        if not accelerator.sync_gradients:
            continue
        step += 1
        progress.update(1)
        # No progress bar here: it would show the loss with 3 decimals, and attention-output MSEs are often smaller.
        record = training_record(accelerator, args, step, run.max_steps, train_loss, run.scheduler, started)
        if record.get("train_loss") is not None:
            progress.set_postfix(loss=f"{record['train_loss']:.4g}")
        if args.eval_steps and step % args.eval_steps == 0:
            per_layer = evaluate_on(accelerator, args, transfer, heldout_loader)
            record["eval_transfer_loss"] = sum(per_layer) / len(per_layer)
            record.update({f"eval_transfer_loss_layer{layer}": value
                           for layer, value in zip(transfer.layers, per_layer, strict=True)})
        log_and_checkpoint(accelerator, args, Path(args.output_dir), step, record, run.guard)
        if step >= run.max_steps:
            break
    progress.close()
    return step, run.guard.training_seconds()


def save_results(accelerator, args, student, tokenizer, results: dict, step: int) -> None:
    """The transferred student (with the tokenizer), the results, arguments and curves, recorded in the run."""
    output_dir = Path(args.output_dir)
    accelerator.log({"transfer_loss_before": results["transfer_loss_before"],
                     "transfer_loss_after": results["transfer_loss_after"]}, step=step)
    tokenizer.model_max_length = student.config.max_position_embeddings
    save_final_model(accelerator, student, output_dir, tokenizer=tokenizer)
    if accelerator.is_main_process:
        write_json(output_dir / RESULTS_FILE, results)
        write_json(output_dir / ARGS_FILE, {k: v for k, v in vars(args).items() if k != "hub_token"})
        plot_curves(output_dir / METRICS_FILE, output_dir / "curves.png", title=str(output_dir))
        record_outputs(output_dir)
    accelerator.print(f"held-out transfer loss (mean MSE over layers {results['transferred_layers']}): "
                      f"{results['transfer_loss_before']:.4g} -> {results['transfer_loss_after']:.4g}; model saved "
                      f"to {output_dir}. Next: fine-tune it with scripts/train_lm.py --model_name_or_path "
                      f"{output_dir}")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
