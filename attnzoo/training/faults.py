"""The faults a long training run meets, handled the same way in every script by one `TrainingGuard`: a stop signal
(a scheduler's SIGTERM before preemption, Ctrl-C), an optimizer step whose loss or gradient norm is not finite, and
a checkpoint save that fails.

- Stop signals. SIGTERM and SIGINT only set a flag while training batches are being consumed (`watch`); the step in
  progress finishes (all its accumulated micro-batches). After each optimizer step the processes agree on the flag
  (one integer all-reduced over a CPU group: no accelerator sync), save a checkpoint of that step, and exit with
  128 + the signal number (143 for SIGTERM, 130 for SIGINT), the shell's code for "ended by that signal", which
  schedulers and job wrappers read as "not finished". A repeated signal changes nothing, since launchers forward the
  signal their process group already received; SIGKILL stops at once.
- Non-finite steps. Every micro-batch's loss and every step's gradient norm are checked on the device; fused AdamW
  skips the update of a flagged step inside its kernel (the `found_inf` input that GradScaler uses), so no value is
  read back per step. The flags are read on logging and checkpoint steps, where the loop reads the loss anyway: the
  metrics record counts the skipped steps (`skipped_steps`, and `skipped_at` for the new ones), and more than
  --max_nonfinite_steps of them stop the run, after a checkpoint, with a message naming the steps. A skipped step
  still counts as a step: its batch is used up and the learning-rate schedule advances, so the schedule stays a
  function of the step number and a resumed run replays the same steps.
- Failed saves. A checkpoint that cannot be written is reported and training goes on (the previous checkpoint is
  intact); more than --max_failed_saves failures in a row stop the run, so unsaved work does not pile up.
- Training time. A checkpoint keeps the seconds trained up to it, and a resumed run's clock (`start_clock`) starts
  from them, so the logged `elapsed_s` and the results' `train_seconds` count the whole run, not its last part.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from attnzoo.training.checkpoints import (
    CheckpointSaveError,
    checkpoint_dir,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a process receives when its parent exits
REMEMBERED_STEPS = 10  # how many of the latest skipped steps a message names


def _stop_when_launcher_exits(sig: int) -> bool:
    """Under a one-process `accelerate launch`, have Linux send this process `sig` when the launcher exits (prctl
    PR_SET_PDEATHSIG; 0 clears it). That launcher waits on its one child and forwards no signal, so a SIGTERM sent to
    it alone (`docker stop`, a scheduler signalling the job's main process) would kill it and leave training running
    with nothing saved; now the launcher's death stops training like a SIGTERM of its own. Multi-process launches
    need none of this (torchrun's agent forwards signals to its workers), nor does a script started with `python`,
    whose parent is a shell that may exit while the run should go on (nohup). Returns whether it was set."""
    launched_alone = "ACCELERATE_USE_CPU" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
    if sys.platform != "linux" or not launched_alone:
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


class NonFiniteStepsError(RuntimeError):
    """More optimizer steps had a non-finite loss or gradient norm than --max_nonfinite_steps allows."""


class TrainingGuard:
    """Watches one training loop for stop signals, non-finite steps and failed saves (see the module docstring).

    The shared loop functions call it: `training_step` (`watch_loss`, `watch_grad_norm`, `optimizer_step`),
    `log_and_checkpoint` (`after_step`) and `resume_if_asked` (`load_state_dict`); a script builds it after
    `accelerator.prepare` and wraps its batches in `watch`. Every process must build it (it may create a process
    group).
    """

    def __init__(self, accelerator, args, output_dir: str | Path):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.checkpoints_total_limit = args.checkpoints_total_limit
        self.max_nonfinite_steps = args.max_nonfinite_steps
        self.max_failed_saves = args.max_failed_saves
        self.skipped_steps = 0
        self.latest_skipped: list[int] = []
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, non-finite flag on the device), not read yet
        self._loss_nonfinite: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self._step_nonfinite: torch.Tensor | None = None
        self._failed_saves = 0
        self._saved_step: int | None = None
        self._signal = 0
        self._signal_group = _cpu_process_group(accelerator)
        self.resumed_seconds = 0.0  # seconds trained before the checkpoint this run resumed from
        self._clock: float | None = None

    # -- checkpointed counters -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "latest_skipped": list(self.latest_skipped),
                "train_seconds": self._seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.latest_skipped = [int(s) for s in state.get("latest_skipped", [])]
        self.resumed_seconds = float(state.get("train_seconds", 0.0))

    # -- training time ---------------------------------------------------------------------------------------------
    def start_clock(self) -> float:
        """Start timing the training loop; returns its start as if the run had never stopped (now, less the seconds
        trained before the checkpoint it resumed from), the `started` that `training_record` takes."""
        self._clock = time.time() - self.resumed_seconds
        return self._clock

    def training_seconds(self) -> float:
        """Seconds trained so far, counting those before a resume (to a tenth, as reported)."""
        return round(self._seconds(), 1)

    def _seconds(self) -> float:
        return self.resumed_seconds if self._clock is None else time.time() - self._clock

    # -- stop signals ----------------------------------------------------------------------------------------------
    def watch(self, batches: Iterable) -> Iterator:
        """`batches`, with SIGTERM/SIGINT turned into a stop after the current optimizer step while they are being
        consumed; the previous handlers come back when the loop ends (also by `break` or an exception)."""
        if threading.current_thread() is not threading.main_thread():  # Python delivers signals to the main thread
            yield from batches
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        follows_launcher = _stop_when_launcher_exits(signal.SIGTERM)
        try:
            yield from batches
        finally:
            if follows_launcher:
                _stop_when_launcher_exits(0)
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        if self._signal:
            return
        self._signal = signum
        if self.accelerator.is_local_main_process:  # os.write: print() is not safe inside a signal handler
            os.write(2, f"\nreceived {signal.Signals(signum).name}: stopping after this optimizer step, with a "
                        "checkpoint (SIGKILL stops at once)\n".encode())

    def _agreed_signal(self) -> int:
        """The stop signal any process received (0: none); every process gets the same answer."""
        if self.accelerator.num_processes == 1:
            return self._signal
        import torch.distributed as dist

        flag = torch.tensor([self._signal], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._signal_group)
        return int(flag.item())

    # -- non-finite steps ------------------------------------------------------------------------------------------
    @property
    def needs_grad_norm(self) -> bool:
        """Whether `training_step` must compute the gradient norm for the guard (with fp16, GradScaler watches the
        gradients itself)."""
        return self.accelerator.scaler is None

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Flag a non-finite micro-batch loss (on the device; flags of one accumulation group are OR-ed)."""
        nonfinite = ~torch.isfinite(loss.detach())
        self._loss_nonfinite = nonfinite if self._loss_nonfinite is None else self._loss_nonfinite | nonfinite

    def watch_grad_norm(self, grad_norm: torch.Tensor | None) -> None:
        """The total gradient norm of the step (clip_grad_norm_'s return value: the same on every process, since the
        gradients are already averaged); None where the backend does not return it."""
        self._grad_norm = grad_norm

    def optimizer_step(self, optimizer) -> None:
        """`optimizer.step()`, except that a step whose loss (on any process) or gradient norm is not finite changes
        nothing: fused AdamW skips it on the device; another optimizer's step is skipped after reading the flag."""
        if not self.accelerator.sync_gradients:
            optimizer.step()  # accelerate makes this a no-op inside an accumulation group
            return
        nonfinite = self._loss_nonfinite if self._loss_nonfinite is not None else torch.zeros((), dtype=torch.bool)
        nonfinite = nonfinite.to(self.accelerator.device)
        if self.accelerator.num_processes > 1:  # a loss is per process; the step must be skipped everywhere
            nonfinite = self.accelerator.reduce(nonfinite.float(), "sum") > 0
        if self._grad_norm is not None and self.needs_grad_norm:
            nonfinite = nonfinite | ~torch.isfinite(self._grad_norm.detach().to(nonfinite.device))
        self._loss_nonfinite = self._grad_norm = None
        self._step_nonfinite = nonfinite
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        if self.accelerator.scaler is not None:  # fp16: GradScaler skips steps with inf/NaN gradients
            optimizer.step()
        elif getattr(inner, "_step_supports_amp_scaling", False):  # fused: skipped inside the kernel
            inner.found_inf = nonfinite.float()
            try:
                optimizer.step()
            finally:
                del inner.found_inf
        elif not bool(nonfinite):
            optimizer.step()

    def _read_flags(self, record: dict) -> None:
        """Read the flags of the steps since the last read (one transfer) into the counters and `record`."""
        if self._pending:
            steps = [step for step, _ in self._pending]
            flags = torch.stack([flag for _, flag in self._pending]).cpu().tolist()
            self._pending.clear()
            new = [step for step, nonfinite in zip(steps, flags, strict=True) if nonfinite]
            if new:
                self.skipped_steps += len(new)
                self.latest_skipped = (self.latest_skipped + new)[-REMEMBERED_STEPS:]
                record["skipped_at"] = new
                if self.accelerator.is_main_process:
                    logger.warning(f"non-finite loss or gradient norm at step(s) {new}: their updates were "
                                   f"skipped ({self.skipped_steps} so far; the run stops after more than "
                                   f"--max_nonfinite_steps={self.max_nonfinite_steps})")
        if self.skipped_steps:
            record["skipped_steps"] = self.skipped_steps

    # -- after each optimizer step ---------------------------------------------------------------------------------
    def after_step(self, step: int, record: dict, checkpoint_now: bool) -> None:
        """Log `record` (with the skipped-step counts), save the checkpoint if `checkpoint_now`, then stop the run
        (after a checkpoint) on a stop signal or too many non-finite steps."""
        signum = self._agreed_signal()
        if self._step_nonfinite is not None:
            self._pending.append((step, self._step_nonfinite))
            self._step_nonfinite = None
        if record or checkpoint_now or signum:
            self._read_flags(record)
        if record:
            self.accelerator.log(record, step=step)
        if checkpoint_now:
            self.save(step)
        if signum:
            self._stop_for_signal(step, signum)
        if self.skipped_steps > self.max_nonfinite_steps:
            self._stop_for_nonfinite_steps(step)

    def save(self, step: int) -> bool:
        """Save the checkpoint of `step`; a failure is reported and training goes on, unless more than
        --max_failed_saves saves in a row failed (CheckpointSaveError). Returns whether it was saved."""
        try:
            save_checkpoint(self.accelerator, self.output_dir, step, self.checkpoints_total_limit,
                            loop_state=self.state_dict())
        except CheckpointSaveError as err:
            self._failed_saves += 1
            if self._failed_saves > self.max_failed_saves:
                raise CheckpointSaveError(f"{err} {self._failed_saves} saves in a row failed, more than "
                                          f"--max_failed_saves={self.max_failed_saves}: stopping so that no more "
                                          "unsaved work piles up. Resume with --resume_from_checkpoint latest once "
                                          "the cause is fixed.") from err
            if self.accelerator.is_main_process:
                logger.warning(f"{err} Training goes on; it stops if more than --max_failed_saves="
                               f"{self.max_failed_saves} saves in a row fail.")
            return False
        self._failed_saves = 0
        self._saved_step = step
        return True

    def _save_before_stopping(self, step: int) -> str:
        """Save the state of `step` if it is not saved yet; a sentence saying where the run can resume from."""
        if self._saved_step == step:
            return f"the training state after step {step} is in {checkpoint_dir(self.output_dir, step)}"
        try:
            saved = self.save(step)
        except CheckpointSaveError as err:
            logger.error(str(err))
            saved = False
        if saved:
            return f"the training state after step {step} is in {checkpoint_dir(self.output_dir, step)}"
        newest = [folder.name for _, folder in list_checkpoints(self.output_dir) if not verify_checkpoint(folder)][-1:]
        return (f"the state after step {step} could not be saved (see above); resuming continues from the newest "
                f"valid checkpoint ({newest[0] if newest else 'none: the run starts afresh'}) and redoes the steps "
                "after it")

    def _stop_for_signal(self, step: int, signum: int) -> None:
        where = self._save_before_stopping(step)
        self.accelerator.print(f"stopped by {signal.Signals(signum).name} after step {step}: {where}. To continue, "
                               "run the same command with --resume_from_checkpoint latest.", flush=True)
        self.accelerator.end_training()
        raise SystemExit(128 + signum)

    def _stop_for_nonfinite_steps(self, step: int) -> None:
        where = self._save_before_stopping(step)
        self.accelerator.end_training()
        raise NonFiniteStepsError(
            f"step {step}: {self.skipped_steps} optimizer steps had a non-finite (NaN or inf) loss or gradient norm "
            f"(the latest at steps {self.latest_skipped}), more than --max_nonfinite_steps="
            f"{self.max_nonfinite_steps}. Their updates were skipped, so the weights are intact: {where}. Usual "
            "remedies: a lower --learning_rate or a longer --num_warmup_steps, gradient clipping (--max_grad_norm "
            "1.0), bf16 or float32 instead of fp16, and a look at the training examples near those steps; then "
            "resume with --resume_from_checkpoint latest (or start afresh), or raise --max_nonfinite_steps.")


def _cpu_process_group(accelerator):
    """A process group for the per-step stop-flag all-reduce on CPU tensors: the default one when it is gloo (CPU
    runs, or "cpu:gloo,cuda:nccl"), otherwise a new gloo group, so the check never waits for the accelerator."""
    if accelerator.num_processes == 1:
        return None
    import torch.distributed as dist

    return None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")
