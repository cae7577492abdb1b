"""Train a causal language model with any attnzoo family and report bits/dim on held-out data.

Three kinds of data (--corpus):

  text        any text: a local file (default: the English text that ships with CPython, no download), json/csv
              files, or a `datasets` dataset (--dataset_name); byte-level (token id == byte) for a new model, the
              checkpoint's tokenizer with --model_name_or_path (fine-tuning).
  enwik8      enwik8-64K (Reformer, arXiv 2001.04451, §5): the raw enwik8 file or zip, the 90M/5M/5M byte split,
              65,536-byte blocks.
  imagenet64  pixel-level image generation: each 64x64x3 image is 12,288 sub-pixel tokens (vocab 256 + a start
              token), from .npy/.npz arrays, image folders or a `datasets` dataset; bits/dim over all sub-pixels.

    accelerate launch scripts/train_lm.py --recipe recipes/quickstart_lm.yaml --output_dir runs/quickstart
    accelerate launch scripts/train_lm.py --recipe recipes/reformer_enwik8.yaml --data_dir data/enwik8

Fine-tuning a checkpoint (--model_name_or_path) trains every weight, or, with --lora_r, LoRA adapters through peft
(`pip install 'attnzoo[peft]'`) that are merged into the weights at the end (docs/attention_transfer.md):

    accelerate launch scripts/train_lm.py --model_name_or_path converted --lora_r 8 --lora_alpha 16 --output_dir tuned

The output folder loads with `AutoModelForCausalLM.from_pretrained` (and `AutoTokenizer` for text).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnzoo.tokenization import byte_level_tokenizer, is_byte_level
from attnzoo.training.arguments import add_model_arguments, add_training_arguments, check_training_arguments
from attnzoo.training.image_data import (
    PIXEL_VOCAB_SIZE,
    PixelSequences,
    load_image_sources,
    pixel_sequence_length,
)
from attnzoo.training.lm_loss import answer_weighted_lm_loss
from attnzoo.training.loop import (
    RunningMean,
    build_accelerator,
    eval_loader,
    log_and_checkpoint,
    new_model_config,
    prepare_run,
    progress_bar,
    save_final_model,
    train_batches,
    train_loader,
    training_record,
    training_step,
)
from attnzoo.training.lora import (
    add_lora,
    add_lora_arguments,
    check_lora_arguments,
    check_resumed_lora,
    lora_enabled,
    merge_lora,
    record_lora_settings,
    trainable_parameters,
)
from attnzoo.training.metrics import evaluate_bits_per_dim
from attnzoo.training.model_card import bits_per_dim_result, build_model_card
from attnzoo.training.publish import publish_run
from attnzoo.training.recipes import parse_with_recipe
from attnzoo.training.text_data import (
    ENWIK8_HELDOUT_BYTES,
    PASSKEY_FRACTION_HELP,
    PASSKEY_MIN_DISTANCE_HELP,
    TokenBlocks,
    check_passkey_options,
    count_passkey_blocks,
    find_enwik8,
    load_text_splits,
    read_enwik8,
    split_enwik8,
    with_passkey_blocks,
)

CORPORA = ("text", "enwik8", "imagenet64")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    data = parser.add_argument_group("data")
    data.add_argument("--corpus", default="text", choices=CORPORA)
    data.add_argument("--train_file", default=None,
                      help="text: a .txt/.json/.csv file; enwik8: the enwik8 file or zip; imagenet64: .npy/.npz "
                           "arrays (comma list or glob)")
    data.add_argument("--validation_file", default=None)
    data.add_argument("--dataset_name", default=None, help="a `datasets` dataset (text or images)")
    data.add_argument("--dataset_config_name", default=None)
    data.add_argument("--text_column", default="text")
    data.add_argument("--tokenizer_name", default=None, help="tokenizer for fine-tuning (default: the checkpoint's)")
    data.add_argument("--data_dir", default=None, help="enwik8: folder holding enwik8 or enwik8.zip")
    data.add_argument("--heldout_fraction", type=float, default=0.05,
                      help="text without a validation split: hold out this final fraction")
    data.add_argument("--heldout_bytes", type=int, default=ENWIK8_HELDOUT_BYTES,
                      help="enwik8: size of the validation and of the test split (5M: the standard split)")
    data.add_argument("--block_size", type=int, default=256, help="tokens per training sequence (text, enwik8)")
    data.add_argument("--train_stride", type=int, default=0,
                      help="start a training block every N tokens (0: block_size, no overlap)")
    data.add_argument("--passkey_fraction", type=float, default=0.0,
                      help=f"text and enwik8: {PASSKEY_FRACTION_HELP}")
    data.add_argument("--passkey_min_distance", type=int, default=0, help=PASSKEY_MIN_DISTANCE_HELP)
    data.add_argument("--passkey_answer_weight", type=float, default=1.0,
                      help="the passkey answer tokens' weight in the loss (a weighted mean over tokens; 1: as any "
                           "other token). The answer is ~6 tokens of a block, so retrieval gets ~1%% of the "
                           "gradient unweighted; 20-50 makes small models learn it (docs/long_context.md)")
    data.add_argument("--train_dir", default=None, help="imagenet64: folder of training images")
    data.add_argument("--validation_dir", default=None, help="imagenet64: folder of held-out images")
    data.add_argument("--image_size", type=int, default=64, help="imagenet64: image side (64 -> 12,288 tokens)")
    data.add_argument("--image_column", default="image")
    sample = parser.add_argument_group("sample")
    sample.add_argument("--sample_prompt", default="The ")
    sample.add_argument("--sample_tokens", type=int, default=120, help="text: greedy sample at the end (0: none)")
    add_lora_arguments(parser)
    add_training_arguments(parser, per_device_train_batch_size=16, per_device_eval_batch_size=16,
                           learning_rate=1e-3, num_warmup_steps=50, max_train_steps=500, output_dir="runs/lm")
    return parser


def check_arguments(args) -> None:
    check_training_arguments(args)
    if args.image_size < 1:
        raise ValueError(f"--image_size={args.image_size} is invalid: set a positive image side.")
    if args.corpus == "enwik8" and args.dataset_name:
        raise ValueError("--corpus enwik8 reads the raw file (--data_dir or --train_file); the Hub copy LTCB/enwik8 "
                         "is a loading script that datasets >= 4 refuses. Drop --dataset_name.")
    if args.train_stride < 0:
        raise ValueError(f"--train_stride={args.train_stride} is invalid: set 0 (= block_size) or a positive stride.")
    check_passkey_options(args.passkey_fraction, args.passkey_min_distance, args.block_size,
                          args.passkey_answer_weight)
    if args.passkey_fraction and args.corpus == "imagenet64":
        raise ValueError("--passkey_fraction mixes passkey text into text corpora; drop it with --corpus imagenet64.")
    check_lora_arguments(args)


def load_tokenizer(args):
    """The tokenizer a text run uses, and whether it is the byte-level one (id == byte)."""
    if args.corpus == "imagenet64":
        return None, True
    name = args.tokenizer_name or args.model_name_or_path
    tokenizer = byte_level_tokenizer() if name is None else AutoTokenizer.from_pretrained(name)
    return tokenizer, is_byte_level(tokenizer)


def load_datasets(args, tokenizer, byte_level: bool):
    """(train, held-out, test or None, sequence length) for the chosen corpus."""
    if args.corpus == "imagenet64":
        train_images, heldout_images = load_image_sources(args)
        return (PixelSequences(train_images), PixelSequences(heldout_images), None,
                pixel_sequence_length(args.image_size))
    stride = args.train_stride or args.block_size
    if args.corpus == "enwik8":
        splits = split_enwik8(read_enwik8(find_enwik8(args.data_dir, args.train_file)), args.heldout_bytes)
        return (with_passkey_blocks(TokenBlocks(splits["train"], args.block_size, stride), args.passkey_fraction,
                                    tokenizer, args.block_size, args.seed, args.passkey_min_distance),
                TokenBlocks(splits["validation"], args.block_size),
                TokenBlocks(splits["test"], args.block_size), args.block_size)
    train_tokens, heldout_tokens = load_text_splits(args, tokenizer, byte_level)
    train_set = with_passkey_blocks(TokenBlocks(train_tokens, args.block_size, stride), args.passkey_fraction,
                                    tokenizer, args.block_size, args.seed, args.passkey_min_distance)
    return train_set, TokenBlocks(heldout_tokens, args.block_size), None, args.block_size


def build_model(args, sequence_length: int, vocab_size: int, tokenizer=None):
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    values = dict(vocab_size=vocab_size, max_position_embeddings=sequence_length, is_decoder=True)
    if tokenizer is not None:  # generate() stops at the end of a text and pads batches with these
        values.update(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(new_model_config(args.family, values, args.model))


def main(argv=None):
    args = parse_with_recipe(build_parser(), argv)
    check_arguments(args)
    check_resumed_lora(args)
    accelerator = build_accelerator(args, "train_lm")
    set_seed(args.seed)
    tokenizer, data, model = build_data_and_model(args, accelerator)
    heldout_loader = eval_loader(data.heldout, args.per_device_eval_batch_size, accelerator)
    run = prepare_run(accelerator, args, model, train_loader(data.train, args.per_device_train_batch_size, args.seed),
                      "train_lm")
    record_lora_settings(accelerator, args)
    report_start(accelerator, args, run, data)
    step, last_eval, seconds = train(accelerator, args, run, heldout_loader)
    results = final_results(accelerator, args, run, data, heldout_loader, step, last_eval, seconds)
    save_and_publish(accelerator, args, run.model, tokenizer, results)
    accelerator.end_training()
    return results["eval_bits_per_dim"]


class LMData(NamedTuple):
    """The training, held-out and test sets (test: enwik8 only) and their sequence length."""

    train: object
    heldout: object
    test: object | None
    sequence_length: int


def build_data_and_model(args, accelerator):
    """The tokenizer, the data sets (built once per machine) and the model (with its LoRA adapters, if asked for)."""
    tokenizer, byte_level = load_tokenizer(args)
    with accelerator.main_process_first():  # `datasets` caches are built once
        data = LMData(*load_datasets(args, tokenizer, byte_level))
    vocab_size = PIXEL_VOCAB_SIZE if args.corpus == "imagenet64" else len(tokenizer)
    model = build_model(args, data.sequence_length, vocab_size, tokenizer)
    if model.config.max_position_embeddings < data.sequence_length:
        raise ValueError(f"sequences of {data.sequence_length} tokens exceed the model's max_position_embeddings="
                         f"{model.config.max_position_embeddings}; lower --block_size.")
    if lora_enabled(args):  # before the optimizer is built: it takes the parameters that train, the adapters
        model = add_lora(model, args)
    return tokenizer, data, model


def report_start(accelerator, args, run, data: LMData) -> None:
    if lora_enabled(args):
        accelerator.print(f"LoRA r={args.lora_r}: {trainable_parameters(run.model):,} trainable adapter parameters")
    accelerator.print(f"{run.num_parameters / 1e6:.2f}M parameters, {len(data.train)} training sequences of "
                      f"{data.sequence_length} tokens, {len(data.heldout)} held-out, {run.max_steps} steps, "
                      f"{accelerator.num_processes} process(es)")


def train(accelerator, args, run, heldout_loader) -> tuple[int, tuple[int, float] | None, float]:
    """The training loop from the run's start step: (the last step, (step, bits/dim) of the newest evaluation or
    None, seconds spent)."""
    model, step = run.model, run.start_step
    progress = progress_bar(accelerator, run.max_steps, step)
    train_loss = RunningMean()
    started = run.guard.start_clock()
    model.train()
    last_eval = None
    for batch in run.guard.watch(train_batches(accelerator, run.loader, step)) if step < run.max_steps else ():
        loss = training_step(accelerator, model, run.optimizer, run.scheduler, args.max_grad_norm,
                             lambda b=batch: batch_loss(model, b, args.passkey_answer_weight), run.guard)
        train_loss.add(loss)
        if not accelerator.sync_gradients:
            continue
        step += 1
        progress.update(1)
        record = training_record(accelerator, args, step, run.max_steps, train_loss, run.scheduler, started, progress)
        if "train_loss" in record:
            record["train_bits_per_dim"] = record["train_loss"] / math.log(2)
        if args.eval_steps and step % args.eval_steps == 0:
            record["eval_bits_per_dim"] = evaluate_bits_per_dim(model, heldout_loader, accelerator,
                                                                args.max_eval_batches)
            last_eval = (step, record["eval_bits_per_dim"])
        log_and_checkpoint(accelerator, args, Path(args.output_dir), step, record, run.guard)
        if step >= run.max_steps:
            break
    progress.close()
    return step, last_eval, run.guard.training_seconds()


def batch_loss(model, batch: dict, answer_weight: float) -> torch.Tensor:
    """The model's own next-token loss, or with passkey answers weighted (`--passkey_answer_weight`) the weighted one
    from its logits."""
    if answer_weight == 1.0 or "answer_mask" not in batch:
        return model(input_ids=batch["input_ids"], labels=batch.get("labels", batch["input_ids"])).loss
    logits = model(input_ids=batch["input_ids"]).logits
    return answer_weighted_lm_loss(logits, batch["input_ids"], batch["answer_mask"], answer_weight)


def final_results(accelerator, args, run, data: LMData, heldout_loader, step: int, last_eval,
                  train_seconds: float) -> dict:
    if last_eval is not None and last_eval[0] == step:  # the last step was an evaluation step: don't repeat it
        eval_bpd = last_eval[1]
    else:
        eval_bpd = evaluate_bits_per_dim(run.model, heldout_loader, accelerator, args.max_eval_batches)
    results = {"eval_bits_per_dim": eval_bpd, "train_steps": step, "corpus": args.corpus,
               "sequence_length": data.sequence_length, "num_parameters": run.num_parameters,
               "num_train_sequences": len(data.train), "num_passkey_sequences": count_passkey_blocks(data.train),
               "train_seconds": train_seconds, "num_processes": accelerator.num_processes}
    if data.test is not None:
        test_loader = eval_loader(data.test, args.per_device_eval_batch_size, accelerator)
        results["test_bits_per_dim"] = evaluate_bits_per_dim(run.model, test_loader, accelerator,
                                                             args.max_eval_batches)
    if args.corpus == "imagenet64":
        results["image_size"] = args.image_size
    accelerator.log({k: v for k, v in results.items() if k.endswith("bits_per_dim")}, step=step)
    return results


def save_and_publish(accelerator, args, model, tokenizer, results: dict) -> None:
    """The final model (LoRA adapters merged into a plain checkpoint), its card and Hub upload, and a sample."""
    output_dir = Path(args.output_dir)
    plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)
    if lora_enabled(args):
        results["lora_trainable_parameters"] = trainable_parameters(plain_model)
        model = plain_model = merge_lora(plain_model)
        results["num_parameters"] = sum(p.numel() for p in plain_model.parameters())
        results["lora"] = {"r": args.lora_r, "alpha": args.lora_alpha or 2 * args.lora_r,
                           "dropout": args.lora_dropout or 0.0, "target_modules": args.lora_target_modules}
    if tokenizer is not None:
        tokenizer.model_max_length = plain_model.config.max_position_embeddings
    unwrapped = save_final_model(accelerator, model, output_dir, tokenizer=tokenizer)
    results["family"] = unwrapped.config.model_type.removeprefix("attnzoo_")  # also right for fine-tuning
    accelerator.print(f"held-out bits/dim: {results['eval_bits_per_dim']:.4f}"
                      + (f", test bits/dim: {results['test_bits_per_dim']:.4f}" if "test_bits_per_dim" in results
                         else "") + f"; model saved to {output_dir}")
    publish_run(accelerator, args, results, lambda: lm_card(args, unwrapped, results), title=str(output_dir))
    if accelerator.is_main_process and args.sample_tokens and tokenizer is not None:
        accelerator.print("sample:", repr(sample(output_dir, args.sample_prompt, args.sample_tokens)))


def lm_card(args, model, results: dict):
    if args.corpus == "enwik8":
        dataset = ("enwik8", "enwik8")
        evals = [bits_per_dim_result(results["eval_bits_per_dim"], *dataset, "validation"),
                 bits_per_dim_result(results["test_bits_per_dim"], *dataset, "test")]
    elif args.corpus == "imagenet64":
        dataset = (args.dataset_name or f"imagenet{args.image_size}", args.dataset_name or "imagenet64")
        evals = [bits_per_dim_result(results["eval_bits_per_dim"], *dataset, "validation",
                                     task_type="unconditional-image-generation")]
    else:
        name = args.dataset_name or Path(args.train_file or "cpython-pydoc-topics.txt").name
        dataset = (name, args.dataset_name or "text")
        evals = [bits_per_dim_result(results["eval_bits_per_dim"], *dataset, "validation")]
    return build_model_card(
        "causal_lm", args=args, config=model.config, num_parameters=results["num_parameters"], results=results,
        eval_results=evals, pipeline_tag="text-generation" if args.corpus != "imagenet64" else None,
        datasets=[args.dataset_name] if args.dataset_name else None, corpus=args.corpus,
        dataset_name=dataset[0], sequence_length=results["sequence_length"], image_size=args.image_size)


def sample(model_dir: Path, prompt: str, new_tokens: int) -> str:
    """Reload the saved folder the way a user would and generate greedily, at most as many tokens as the model has
    positions (the prompt's last tokens are kept if it alone fills them)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    positions = model.config.max_position_embeddings
    ids = tokenizer(prompt, return_tensors="pt").input_ids[:, -(positions - 1):]
    out = model.generate(ids, max_new_tokens=min(new_tokens, positions - ids.shape[1]), do_sample=False)
    return tokenizer.decode(out[0], errors="replace")


if __name__ == "__main__":
    main()
