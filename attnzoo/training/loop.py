"""The pieces of a training loop every script shares: the Accelerator, optimizer and schedule, exact resume, the
stream of training batches that continues where a checkpoint stopped, evaluation shards, saving the final model.

Exact resume rests on four things, all set up here: a seedable sampler (the shuffle order of an epoch depends only
on seed + epoch), data loaders with their own generators (creating an iterator then never draws from the global RNG
that dropout and random features use), `accelerator.save_state` (weights incl. buffers such as Performer's redraw
counter, optimizer, scheduler, RNG states of every process) and skipping the micro-batches already consumed.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, TorchDynamoPlugin, send_to_device
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm.auto import tqdm
from transformers import AutoConfig, get_scheduler

from attnzoo.configuration.base import PEER_SPELLINGS
from attnzoo.training.checkpoints import (
    CheckpointSaveError,
    any_process,
    read_loop_state,
    resolve_resume,
    save_checkpoint,
)
from attnzoo.training.faults import TrainingGuard
from attnzoo.training.recipes import parse_model_overrides
from attnzoo.training.run_dir import check_output_dir, record_outputs, start_output_dir
from attnzoo.training.threads import set_cpu_threads
from attnzoo.training.tracking import build_trackers

FINAL_PARTIAL = ".final_model.partial"  # where the final model is written before it is moved into place
COMPILED_PREFIX = "_orig_mod."  # what torch.compile's wrapper puts before its module's state-dict keys
LM_NO_DECAY = ("embed", "position", "cls_token")  # the LM script's historical choice: no decay on any embedding
VISION_NO_DECAY = ("position", "cls_token")  # DeiT/timm: norms, biases, position embeddings and the class token


def build_accelerator(args: argparse.Namespace, run_name: str) -> Accelerator:
    output_dir = Path(args.output_dir)
    check_output_dir(args, run_name)  # before anything is written
    trackers = build_trackers(args.report_to, output_dir, run_name)
    accelerator = Accelerator(
        # Without an accelerator device, `cpu=True` is what makes `accelerate launch --multi_gpu` processes join one
        # gloo process group (MULTI_CPU) instead of each training alone.
        cpu=not torch.accelerator.is_available(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        project_dir=str(output_dir),
        log_with=trackers or None,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        dynamo_plugin=compile_plugin(args),
    )
    set_cpu_threads(getattr(args, "cpu_threads", 0), accelerator.device)
    return accelerator


def compile_plugin(args: argparse.Namespace) -> TorchDynamoPlugin | None:
    """`--torch_compile`: accelerate compiles the prepared model. Whole-graph (every family traces without graph
    breaks) and static shapes: training batches have one shape, and Reformer's checkpointed reversible stack does
    not trace with symbolic shapes in torch 2.14 (docs/compile.md). Without the flag, accelerate's own
    `--dynamo_backend` setting still applies."""
    if not getattr(args, "torch_compile", False):
        return None
    return TorchDynamoPlugin(backend="inductor", fullgraph=True, dynamic=False)


def new_model_config(family: str, values: dict, overrides: list[str]):
    """A new config of `attnzoo_{family}` from the script's values and the user's `--model NAME=VALUE` overrides."""
    from transformers import CONFIG_MAPPING

    model_type = f"attnzoo_{family}"
    if model_type not in CONFIG_MAPPING:
        registered = sorted(t.removeprefix("attnzoo_") for t in CONFIG_MAPPING.keys() if t.startswith("attnzoo_"))
        raise ValueError(f"--family {family}: {model_type} is not registered in this installation; use one of "
                         f"{registered}.")
    user_values = parse_model_overrides(overrides)
    # PreTrainedConfig keeps unknown keyword arguments as attributes, so a misspelt field would be silently ignored.
    defaults = CONFIG_MAPPING[model_type]()
    unknown = sorted(k for k in user_values if not hasattr(defaults, PEER_SPELLINGS.get(k, k)))  # older names too
    if unknown:
        raise ValueError(f"--model {unknown}: not fields of {model_type}'s config; check the spelling (fields are "
                         f"documented in attnzoo.{type(defaults).__name__}).")
    return AutoConfig.for_model(model_type, **{**values, **user_values})


def train_loader(dataset: Dataset, batch_size: int, seed: int, collate_fn=None, drop_last: bool = True) -> DataLoader:
    """A shuffled loader with its own generator (accelerate replaces the sampler by a seedable one)."""
    if len(dataset) < batch_size and drop_last:
        raise ValueError(f"{len(dataset)} training examples cannot fill one batch of {batch_size}; lower "
                         "--per_device_train_batch_size or add data.")
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=drop_last, collate_fn=collate_fn,
                      generator=torch.Generator().manual_seed(seed))


def eval_loader(dataset: Dataset, batch_size: int, accelerator: Accelerator, collate_fn=None) -> DataLoader:
    """This process's share of an evaluation set (examples rank, rank + world, ...): no example is duplicated
    across processes, so summed metrics are exact. Not passed to `prepare`; move batches with `to_device`."""
    shard = Subset(dataset, range(accelerator.process_index, len(dataset), accelerator.num_processes))
    return DataLoader(shard, batch_size=batch_size, collate_fn=collate_fn, generator=torch.Generator())


def to_device(batch, accelerator: Accelerator):
    return send_to_device(batch, accelerator.device)


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float, no_decay_name_parts=LM_NO_DECAY) -> list:
    """Two AdamW groups: decay on weight matrices, none on biases, norms (all 1-D) and names containing any of
    `no_decay_name_parts`."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        skip = param.dim() < 2 or any(part in name for part in no_decay_name_parts)
        (no_decay if skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, args, no_decay_name_parts=LM_NO_DECAY) -> torch.optim.Optimizer:
    """AdamW, fused: one kernel per step (faster than the foreach form on CPU too), and it can skip a step with a
    non-finite gradient on the device (its `found_inf` input; see attnzoo.training.faults)."""
    return torch.optim.AdamW(optimizer_param_groups(model, args.weight_decay, no_decay_name_parts),
                             lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                             fused=True)


def optimizer_steps_per_epoch(num_batches: int, gradient_accumulation_steps: int) -> int:
    """accelerate syncs at the end of each epoch, so a partial accumulation group is one more optimizer step."""
    return math.ceil(num_batches / gradient_accumulation_steps)


def total_train_steps(args, num_batches_per_process: int) -> int:
    """--max_train_steps, or --num_train_epochs over the sharded loader (call after `accelerator.prepare`)."""
    if args.max_train_steps is not None:
        return args.max_train_steps
    per_epoch = optimizer_steps_per_epoch(num_batches_per_process, args.gradient_accumulation_steps)
    return max(1, math.ceil(args.num_train_epochs * per_epoch))


def build_scheduler(optimizer, args, num_training_steps: int, num_processes: int = 1):
    """transformers' schedules. Stepping happens once per optimizer step on each process, so the lengths are
    multiplied by the process count the way accelerate's prepared scheduler expects (it steps `num_processes` times
    per call unless `split_batches`)."""
    specific = {"min_lr": args.min_learning_rate} if args.lr_scheduler_type == "cosine_with_min_lr" else None
    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps * num_processes,
                         num_training_steps=num_training_steps * num_processes, scheduler_specific_kwargs=specific)


def resume_if_asked(accelerator: Accelerator, args, guard=None) -> int:
    """Load the checkpoint `--resume_from_checkpoint` names (after `prepare`), after checking it (`latest` passes over
    damaged ones with a warning), and the `guard`'s counters saved with it; returns the step it was taken at."""
    warn = logging.getLogger(__name__).warning if accelerator.is_main_process else (lambda message: None)
    folder, step = resolve_resume(args.output_dir, args.resume_from_checkpoint, warn=warn)
    if folder is not None:
        try:
            with _rng_restore_watched() as failures:
                accelerator.load_state(str(folder))
        except Exception as err:
            raise RuntimeError(f"{folder} passed the integrity check but does not load ({type(err).__name__}: "
                               f"{err}). If the model, optimizer or number of processes changed since it was saved, "
                               "resume with the original settings; otherwise pass an older "
                               "OUTPUT_DIR/checkpoints/step_N folder.") from err
        if any_process(accelerator, bool(failures)):
            raise RuntimeError(f"{folder}: the random-number states did not load, so the resumed run would not "
                               "repeat the uninterrupted one (dropout, sampling, shuffling). Resume from another "
                               "checkpoint (OUTPUT_DIR/checkpoints/step_N), or start the run over.")
        if guard is not None:
            guard.load_state_dict(read_loop_state(folder))
        accelerator.print(f"resumed from {folder} at step {step}")
    return step


@contextmanager
def _rng_restore_watched():
    """Collect accelerate's report that a checkpoint's random states failed to load: accelerate only logs it, at
    INFO, and carries on (the run would then silently stop being bit-exact)."""
    failures = []

    class Watch(logging.Handler):
        def emit(self, record):
            if "Could not load random states" in record.getMessage():
                failures.append(record.getMessage())

    watched = logging.getLogger("accelerate.checkpointing")
    handler, level = Watch(logging.INFO), watched.level
    watched.addHandler(handler)
    watched.setLevel(logging.INFO)
    try:
        yield failures
    finally:
        watched.removeHandler(handler)
        watched.setLevel(level)


def train_batches(accelerator: Accelerator, loader: DataLoader, start_step: int) -> Iterator:
    """Training micro-batches forever (epoch after epoch), starting right after optimizer step `start_step`.

    The epoch's shuffle is the seedable sampler's for that epoch (and a data set with `set_epoch` is told the epoch
    too), and the micro-batches of the steps already done are skipped without being loaded, so a resumed run sees
    exactly the batches an uninterrupted one would.
    """
    per_epoch = optimizer_steps_per_epoch(len(loader), accelerator.gradient_accumulation_steps)
    if per_epoch == 0:
        raise ValueError(f"each of the {accelerator.num_processes} processes gets no full training batch; lower "
                         "--per_device_train_batch_size or add data.")
    epoch, done = divmod(start_step, per_epoch)
    while True:
        loader.set_epoch(epoch)
        if hasattr(loader.dataset, "set_epoch"):  # data drawn afresh each epoch (text_data.PasskeyDraws)
            loader.dataset.set_epoch(epoch)
        if done:
            yield from accelerator.skip_first_batches(loader, done * accelerator.gradient_accumulation_steps)
        else:
            yield from loader
        epoch, done = epoch + 1, 0


class RunningMean:
    """Sums detached per-step losses on the device and reads them back only when logging (no per-step sync); the
    logged value is the mean over processes too. Non-finite values (steps the guard skips) are left out of the mean
    (NaN if every value was); the metrics record counts those steps separately."""

    def __init__(self):
        self.sums, self.count = None, 0  # sums: [total of the finite values, how many]

    def add(self, value: torch.Tensor) -> None:
        value = value.detach().float()
        finite = torch.isfinite(value)
        sums = torch.stack([torch.where(finite, value, 0.0), finite.float()])
        self.sums = sums if self.sums is None else self.sums + sums
        self.count += 1

    def pop(self, accelerator: Accelerator) -> float | None:
        if self.count == 0:
            return None
        total, count = accelerator.reduce(self.sums, "sum").tolist()
        self.sums, self.count = None, 0
        return total / count if count else math.nan


def training_step(accelerator: Accelerator, model, optimizer, scheduler, max_grad_norm: float, compute_loss,
                  guard=None):
    """One micro-batch: `compute_loss()` (the forward) inside `accelerator.accumulate`, backward, clipping when the
    gradients sync, then the optimizer and schedule steps (accelerate skips them between accumulation steps).
    With a `guard` (attnzoo.training.faults), a step whose loss or gradient norm is not finite leaves the weights and
    the optimizer state as they were (the gradient norm is then computed even without clipping). Returns the loss."""
    with accelerator.accumulate(model):
        loss = compute_loss()
        accelerator.backward(loss)
        if guard is not None:
            guard.watch_loss(loss)
        if accelerator.sync_gradients and (max_grad_norm or (guard is not None and guard.needs_grad_norm)):
            # max_norm=inf only measures: the gradients are multiplied by exactly 1
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
            if guard is not None:
                guard.watch_grad_norm(grad_norm)
        if guard is not None:
            guard.optimizer_step(optimizer)
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return loss


def log_and_checkpoint(accelerator: Accelerator, args, output_dir, step: int, record: dict, guard=None) -> None:
    """After an optimizer step: log the step's record (if any) and save a checkpoint every `checkpointing_steps`.
    With a `guard`, the record also counts skipped non-finite steps, a failed save is reported instead of ending the
    run, and a stop signal or too many non-finite steps end the run here, after a checkpoint."""
    checkpoint_now = bool(args.checkpointing_steps) and step % args.checkpointing_steps == 0
    if guard is not None:
        guard.after_step(step, record, checkpoint_now)
        return
    if record:
        accelerator.log(record, step=step)
    if checkpoint_now:
        save_checkpoint(accelerator, output_dir, step, args.checkpoints_total_limit)


def training_record(accelerator: Accelerator, args, step: int, max_steps: int, train_loss: RunningMean, scheduler,
                    started: float, progress=None) -> dict:
    """The values to log after optimizer step `step`: the mean training loss since the last log, the learning rate
    and the elapsed time every --logging_steps steps and at the last step; {} otherwise. The script adds its
    evaluation metric every --eval_steps steps and logs the record if it is not empty."""
    if step % args.logging_steps and step != max_steps:
        return {}
    record = {"train_loss": train_loss.pop(accelerator), "lr": scheduler.get_last_lr()[0],
              "elapsed_s": round(time.time() - started, 1)}
    if progress is not None and record["train_loss"] is not None:
        progress.set_postfix(loss=f"{record['train_loss']:.3f}")
    return record


def progress_bar(accelerator: Accelerator, total: int, initial: int, desc: str = "train"):
    return tqdm(total=total, initial=initial, desc=desc, disable=not accelerator.is_local_main_process,
                dynamic_ncols=True)


def save_final_model(accelerator: Accelerator, model, output_dir: str | Path, tokenizer=None, state_dict=None):
    """`save_pretrained` of the unwrapped model (full weights, also under FSDP) plus the tokenizer; returns the
    unwrapped model. Like a checkpoint, the save is all or nothing: the files are written into a partial folder and
    moved into `output_dir` only once all of them are written, so a failed save (a full disk) leaves no half-written
    model, and the error says so."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if state_dict is None:
        state_dict = accelerator.get_state_dict(model)
    # accelerate's default unwrap keeps a --torch_compile wrapper, whose state dict prefixes every key with
    # "_orig_mod."; the saved model must load into an uncompiled one.
    state_dict = {key.removeprefix(COMPILED_PREFIX): value for key, value in state_dict.items()}
    output_dir = Path(output_dir)
    partial = output_dir / FINAL_PARTIAL
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    error = None
    try:
        unwrapped.save_pretrained(partial, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, state_dict=state_dict)
        if tokenizer is not None and accelerator.is_main_process:
            tokenizer.save_pretrained(partial)
    except Exception as err:  # a full disk, no write access, ...: reported the same way
        error = err
    if any_process(accelerator, error is not None):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        accelerator.wait_for_everyone()
        cause = f"{type(error).__name__}: {error}" if error is not None else "another process failed to write its part"
        raise CheckpointSaveError(f"could not save the final model in {output_dir} ({cause}); nothing of it was "
                                  "written there, and the checkpoints are intact. Free disk space (or fix write "
                                  "access) and run the same command with --resume_from_checkpoint latest.") from error
    if accelerator.is_main_process:
        for path in sorted(partial.iterdir()):  # renames within one folder: they do not fail for lack of space
            target = output_dir / path.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(path, target)
        partial.rmdir()
        record_outputs(output_dir)
    accelerator.wait_for_everyone()
    return unwrapped


@dataclass
class PreparedRun:
    """What `prepare_run` hands a script's training loop."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    scheduler: object
    guard: TrainingGuard
    start_step: int
    max_steps: int
    num_parameters: int


def prepare_run(accelerator: Accelerator, args, model, loader: DataLoader, run_name: str,
                optimizer: torch.optim.Optimizer | None = None, trained_model=None,
                started_from: str | None = None) -> PreparedRun:
    """The set-up every script shares between building its model and data and its loop: optimizer (AdamW unless
    given), `accelerator.prepare`, the run's length (--max_train_steps, or epochs over the sharded loader; a
    --num_warmup_epochs becomes warm-up steps here), the schedule, the fault guard (stop signals, non-finite steps,
    failed saves), resuming, and the trackers. The run record (`run_dir`) names the script `run_name`, the family of
    `trained_model` (default: `model`) and the model it `started_from` (default: --model_name_or_path)."""
    trained_model = model if trained_model is None else trained_model
    model_type = getattr(getattr(trained_model, "config", None), "model_type", None)
    started_from = started_from if started_from is not None else getattr(args, "model_name_or_path", None)
    optimizer = optimizer or build_optimizer(model, args)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    max_steps = total_train_steps(args, len(loader))
    if getattr(args, "num_warmup_epochs", 0):
        per_epoch = optimizer_steps_per_epoch(len(loader), args.gradient_accumulation_steps)
        args.num_warmup_steps = min(max_steps - 1, round(args.num_warmup_epochs * per_epoch))
    scheduler = accelerator.prepare(build_scheduler(optimizer, args, max_steps, accelerator.num_processes))
    # everything checked and built: the run now takes the folder
    start_output_dir(accelerator, args, run_name, model_type, started_from)
    guard = TrainingGuard(accelerator, args, Path(args.output_dir))
    start_step = resume_if_asked(accelerator, args, guard)
    accelerator.init_trackers(run_name, {k: str(v) for k, v in vars(args).items() if k != "hub_token"})
    if accelerator.is_main_process:  # the trackers' files
        record_outputs(args.output_dir)
    return PreparedRun(model, optimizer, loader, scheduler, guard, start_step, max_steps,
                       sum(p.numel() for p in model.parameters()))
