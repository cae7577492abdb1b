"""Train a byte-level causal language model with any attnzoo family; report bits/dim on held-out text.

    accelerate launch scripts/train_lm.py --recipe recipes/quickstart_lm.yaml --output_dir runs/quickstart

With no --train_file it trains on the English text that ships with CPython, so it needs no download. The result
is a folder that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler

import attnzoo  # noqa: F401  (registers the families with the Auto classes)
from attnzoo.tokenization import byte_level_tokenizer
from attnzoo.training.checkpoints import checkpoint_dir, resolve_resume
from attnzoo.training.metrics import bits_per_dim, summed_token_nats
from attnzoo.training.recipes import parse_model_overrides, parse_with_recipe
from attnzoo.training.text_data import ByteBlocks, read_bytes, split_bytes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="softmax", help="softmax, reformer, performer, ra or lara")
    p.add_argument("--model_name_or_path", default=None, help="start from this checkpoint instead of from scratch")
    p.add_argument("--model", nargs="*", default=[], metavar="NAME=VALUE",
                   help="config values for a new model, e.g. hidden_size=128 attn_layers=[full]")
    p.add_argument("--train_file", default=None, help="raw text file (default: CPython's pydoc topic text)")
    p.add_argument("--heldout_fraction", type=float, default=0.05)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--per_device_train_batch_size", type=int, default=16)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--lr_scheduler_type", default="cosine")
    p.add_argument("--num_warmup_steps", type=int, default=50)
    p.add_argument("--max_train_steps", type=int, default=500)
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--max_eval_batches", type=int, default=0, help="cap held-out batches per evaluation (0: all)")
    p.add_argument("--checkpointing_steps", type=int, default=0, help="save training state every N steps")
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_N folder, or 'latest'")
    p.add_argument("--output_dir", default="runs/lm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--sample_prompt", default="The ")
    p.add_argument("--sample_tokens", type=int, default=120)
    return p


def build_model(args):
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    values = dict(vocab_size=256, max_position_embeddings=args.block_size, is_decoder=True)
    values.update(parse_model_overrides(args.model))
    config = AutoConfig.for_model(f"attnzoo_{args.family}", **values)
    return AutoModelForCausalLM.from_config(config)


def evaluate(model, loader, accelerator, max_batches: int) -> float:
    model.eval()
    nats = torch.zeros((), device=accelerator.device)
    tokens = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        batch_nats, batch_tokens = summed_token_nats(model, batch)
        nats += batch_nats
        tokens += batch_tokens
    model.train()
    nats, tokens = accelerator.reduce(nats, "sum"), accelerator.reduce(tokens, "sum")
    return bits_per_dim(nats.item(), tokens.item())


def main(argv=None):
    args = parse_with_recipe(build_parser(), argv)
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision, project_dir=str(output_dir),
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(args.seed)

    train_bytes, heldout_bytes = split_bytes(read_bytes(args.train_file), args.heldout_fraction)
    train_set, heldout_set = ByteBlocks(train_bytes, args.block_size), ByteBlocks(heldout_bytes, args.block_size)
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True)
    heldout_loader = DataLoader(heldout_set, batch_size=args.per_device_eval_batch_size)

    model = build_model(args)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=args.max_train_steps)
    model, optimizer, train_loader, heldout_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, heldout_loader, scheduler)

    resume_dir, step = resolve_resume(output_dir, args.resume_from_checkpoint)
    if resume_dir is not None:
        accelerator.load_state(str(resume_dir))
        accelerator.print(f"resumed from {resume_dir} at step {step}")
    steps_per_epoch = len(train_loader) // args.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise ValueError("fewer training batches than --gradient_accumulation_steps; lower the batch size.")

    log_path = output_dir / "metrics.jsonl"
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        accelerator.print(f"{n_params / 1e6:.2f}M parameters, {len(train_set)} train blocks of {args.block_size} "
                          f"bytes, {len(heldout_set)} held-out blocks, {args.max_train_steps} steps")
    model.train()
    started, window_loss, window_steps = time.time(), 0.0, 0
    while step < args.max_train_steps:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        train_loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(train_loader, done_in_epoch * args.gradient_accumulation_steps) \
            if done_in_epoch else train_loader
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            window_loss += loss.detach().float().item()
            window_steps += 1
            if step % 25 == 0 or step == args.max_train_steps:
                record = {"step": step, "train_bits_per_dim": window_loss / window_steps / math.log(2),
                          "lr": scheduler.get_last_lr()[0], "elapsed_s": round(time.time() - started, 1)}
                window_loss, window_steps = 0.0, 0
                if args.eval_steps and step % args.eval_steps == 0:
                    record["eval_bits_per_dim"] = evaluate(model, heldout_loader, accelerator, args.max_eval_batches)
                log(accelerator, log_path, record)
            if args.checkpointing_steps and step % args.checkpointing_steps == 0:
                accelerator.save_state(str(checkpoint_dir(output_dir, step)))
            if step >= args.max_train_steps:
                break

    eval_bpd = evaluate(model, heldout_loader, accelerator, args.max_eval_batches)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if accelerator.is_main_process:
        byte_level_tokenizer(model_max_length=unwrapped.config.max_position_embeddings).save_pretrained(output_dir)
        results = {"eval_bits_per_dim": eval_bpd, "train_steps": step, "family": args.family,
                   "train_seconds": round(time.time() - started, 1)}
        (output_dir / "all_results.json").write_text(json.dumps(results, indent=2))
        accelerator.print(f"held-out bits/dim: {eval_bpd:.3f}; model saved to {output_dir}")
        if args.sample_tokens:
            accelerator.print("sample:", repr(sample(output_dir, args.sample_prompt, args.sample_tokens)))
    accelerator.end_training()
    return eval_bpd


def log(accelerator, path: Path, record: dict) -> None:
    if accelerator.is_main_process:
        accelerator.print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def sample(model_dir: Path, prompt: str, new_tokens: int) -> str:
    """Reload the saved folder the way a user would and generate greedily."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0], errors="replace")


if __name__ == "__main__":
    main()
