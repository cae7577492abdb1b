"""Attention transfer, the first stage of linearizing a pretrained Transformer: with every weight frozen, train only
what a converted model's attention learns beyond its q/k/v/output projections (`ZooAttention.own_parameters()`: a
learned FAVOR+ projection, LARA's landmark transforms) so that each layer's attention output matches the source
model's attention output on the same input ("Hedgehog & the Porcupine", arXiv 2402.04347; "LoLCATs", arXiv
2410.10254: MSE between the two outputs, the projections frozen). The second stage, fine-tuning the whole converted
model (fully or with LoRA), is `scripts/train_lm.py`; docs/attention_transfer.md walks through both.

`AttentionTransfer(teacher, student)` is a module whose forward takes token ids, runs the teacher (the source: a
transformers Llama-like or GPT-2 model, or an attnzoo model) with hooks that capture each attention layer's input
(the normalised hidden state) and output (after the output projection, before the residual add), runs the student's
attention of the same layer on the teacher's input, and returns the MSE per layer and their mean. Only layers whose
attention has own parameters are run (a softmax, RA, LSH or local layer has nothing to learn here), and the teacher
stops after the last of them. The module's parameters are exactly those own parameters, shared with the student, so
an optimizer over it trains them, a checkpoint of it holds only them, and DDP synchronises only them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from attnzoo.modeling.attention import DrawsPerForward, ZooAttention
from attnzoo.modeling.backbone import ZooTransformer

#: attribute names under which a layer holds its self-attention: attnzoo's and GPT-2's blocks (`attn`), Llama-like
#: decoder layers (`self_attn`)
ATTENTION_ATTRIBUTES = ("self_attn", "attn")


class TransferLoss(NamedTuple):
    """`loss`: the mean over `per_layer`, what training minimises; `per_layer`: [n_layers] MSE of each transferred
    layer (in `AttentionTransfer.layers` order). A NamedTuple, so DDP and accelerate see the tensors inside."""

    loss: torch.Tensor
    per_layer: torch.Tensor


class _TeacherDone(Exception):
    """Raised by the capture hook once the last needed layer has run: the rest of the teacher is not computed."""


def find_attention_layers(model: nn.Module, flag: str = "model") -> list[nn.Module]:
    """The self-attention module of every layer of `model`, in layer order, found by structure: the one
    `nn.ModuleList` whose every element holds an attention under one of `ATTENTION_ATTRIBUTES` (attnzoo:
    `model.transformer.blocks[i].attn`; GPT-2: `transformer.h[i].attn`; Llama, Qwen2, Mistral:
    `model.layers[i].self_attn`). ValueError naming `flag` when there is none, or more than one such list (an
    encoder-decoder)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        for attribute in ATTENTION_ATTRIBUTES:
            if all(isinstance(getattr(layer, attribute, None), nn.Module) for layer in module):
                found.append((name, [getattr(layer, attribute) for layer in module]))
                break
    if not found:
        raise ValueError(f"{flag}: {type(model).__name__} has no list of layers holding a self-attention module "
                         f"(looked for an nn.ModuleList whose layers have one of {ATTENTION_ATTRIBUTES}, as attnzoo, "
                         "GPT-2 and Llama-like models do); pass a decoder-only language model of one of those kinds.")
    if len(found) > 1:
        raise ValueError(f"{flag}: {type(model).__name__} has several stacks of attention layers "
                         f"({[name for name, _ in found]}); attention transfer pairs the layers of one decoder-only "
                         "stack. Pass a decoder-only language model.")
    return found[0][1]


def masked_mse(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean squared error over the real tokens (`weights` [batch, length], 1 = real; None: all), in float32 at least:
    outputs at padded positions are meaningless (attention/base.py) and must not be fitted."""
    compute = torch.promote_types(prediction.dtype, torch.float32)
    squared = (prediction.to(compute) - target.to(compute)).square()
    if weights is None:
        return squared.mean()
    weights = weights.to(compute)
    return (squared * weights[..., None]).sum() / (weights.sum() * squared.shape[-1]).clamp(min=1)


class AttentionTransfer(nn.Module):
    """Stage 1 of linearizing (module docstring): `forward(input_ids, attention_mask=None) -> TransferLoss`.

    `teacher`: the source model (transformers Llama-like or GPT-2, or attnzoo), kept in eval mode; `student`: the
    attnzoo model converted from it, with the same number of attention layers. `layers`: the layer indices to
    transfer (default: every layer whose attention has own parameters; an explicit list may name others, e.g. to
    measure how far an RA layer is from the teacher, and their own parameters, if any, are trained). Building it
    freezes every parameter of both models except the own parameters of those layers (requires_grad).

    Neither model is a submodule: accelerate must not wrap, cast or checkpoint them (a checkpoint holds the trained
    parameters only). Move both to the training device yourself; `.to()` on this module moves only the trained
    parameters.

    Both models' attentions run in evaluation mode, also while training: the fit is to the function the converted
    model computes at inference. There is no attention dropout then, and a randomized attention uses its
    deterministic estimator (LARA: the proposals' means) instead of training-time sampling noise, which would drown
    the gradient of its landmark transforms and measure a different function than the one evaluated.
    """

    def __init__(self, teacher: nn.Module, student: nn.Module, layers: Sequence[int] | None = None):
        super().__init__()
        teacher_attentions = find_attention_layers(teacher, "teacher")
        student_attentions = find_attention_layers(student, "student")
        not_zoo = sorted({type(a).__name__ for a in student_attentions if not isinstance(a, ZooAttention)})
        if not_zoo:
            raise ValueError(f"student: its attention layers are {not_zoo}, not attnzoo attentions; convert the "
                             "source first (python -m attnzoo.convert.llama / attnzoo.convert.gpt2 SRC DST --family "
                             "...) and pass DST as the student.")
        if len(teacher_attentions) != len(student_attentions):
            raise ValueError(f"the teacher has {len(teacher_attentions)} attention layers and the student "
                             f"{len(student_attentions)}; attention transfer pairs layer i with layer i, so the "
                             "student must be converted from this teacher.")
        teacher_width = getattr(getattr(teacher, "config", None), "hidden_size", None)
        student_width = student_attentions[0].hidden_size
        if teacher_width is not None and teacher_width != student_width:
            raise ValueError(f"the teacher's hidden_size is {teacher_width} and the student's {student_width}; the "
                             "student must be converted from this teacher.")
        if layers is None:
            layers = [i for i, attn in enumerate(student_attentions) if attn.own_parameters()]
            if not layers:
                raise ValueError(f"student: no attention layer has parameters of its own (layers: "
                                 f"{[a.name for a in student_attentions]}), so there is nothing to transfer; "
                                 "fine-tune it directly (scripts/train_lm.py), or pass `layers` to measure the "
                                 "attention gap.")
        else:
            layers = sorted(set(layers))
            bad = [i for i in layers if not 0 <= i < len(student_attentions)]
            if bad or not layers:
                raise ValueError(f"layers={list(layers)} is invalid: name layer indices in [0, "
                                 f"{len(student_attentions)}), at least one.")
        self.layers: tuple[int, ...] = tuple(layers)
        self.kinds: tuple[str, ...] = tuple(a.name for a in student_attentions)
        # Plain attributes, not submodules (class docstring).
        object.__setattr__(self, "teacher", teacher)
        object.__setattr__(self, "student", student)
        object.__setattr__(self, "_teacher_attentions", [teacher_attentions[i] for i in self.layers])
        object.__setattr__(self, "_student_attentions", [student_attentions[i] for i in self.layers])
        for param in [*teacher.parameters(), *student.parameters()]:
            param.requires_grad_(False)
        # The trained parameters, registered here too (the same Parameter objects the student holds), so that
        # parameters(), state_dict() and DDP see them and nothing else. "." may not appear in a parameter name.
        self.own = nn.ParameterDict()
        for layer, attn in zip(self.layers, self._student_attentions, strict=True):
            for name, param in attn.own_parameters():
                param.requires_grad_(True)
                self.own[f"layer{layer}/{name.replace('.', '/')}"] = param
        teacher.eval()

    @property
    def num_trained_parameters(self) -> int:
        return sum(p.numel() for p in self.own.values())

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input, output) of the teacher's attention in each transferred layer, for one batch. The teacher stops
        after the last of them (its later layers, final norm and LM head are not computed)."""
        captured: dict[int, list] = {}
        last = len(self.layers) - 1

        def before(index):
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs.get("hidden_states")
                if not isinstance(hidden, torch.Tensor):
                    raise ValueError(f"the teacher's attention {type(module).__name__} was called without its hidden "
                                     "states as first argument or `hidden_states=`; this model's layout is not "
                                     "supported.")
                captured[index] = [hidden]
            return hook

        def after(index):
            def hook(module, args, output):
                captured[index].append(output[0] if isinstance(output, tuple | list) else output)
                if index == last:
                    raise _TeacherDone
            return hook

        handles = []
        try:
            for index, module in enumerate(self._teacher_attentions):
                handles.append(module.register_forward_pre_hook(before(index), with_kwargs=True))
                handles.append(module.register_forward_hook(after(index)))
            extra = {"position_ids": position_ids} if position_ids is not None else {}
            self.teacher(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        except _TeacherDone:
            pass
        finally:
            for handle in handles:
                handle.remove()
        missing = [self.layers[i] for i in range(len(self.layers)) if len(captured.get(i, ())) != 2]
        if missing:
            raise RuntimeError(f"the teacher's forward did not run the attention of layer(s) {missing}; its layers "
                               "are not called in the order of its layer list.")
        return [tuple(captured[i]) for i in range(len(self.layers))]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TransferLoss:
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        # Both models number positions by counting real tokens, as the zoo's Transformer does, so a padded row gets
        # the positions it would have alone in the teacher too (transformers would count the padding).
        position_ids = None
        if attention_mask is not None:
            position_ids = ZooTransformer._position_ids(attention_mask, 0, input_ids.shape[1], input_ids.device)
        self.teacher.eval()  # (class docstring) set on every call: the models are not submodules, train() misses them
        for attn in self._student_attentions:
            attn.eval()
        captured = self.capture(input_ids, attention_mask, position_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        losses = []
        for attn, (hidden, target) in zip(self._student_attentions, captured, strict=True):
            if isinstance(attn, DrawsPerForward):  # what the Transformer does once per forward pass
                attn.start_forward()
            dtype = next(attn.parameters()).dtype
            extra = {"position_ids": position_ids} if attn.rotary is not None else {}
            out = attn(hidden.to(dtype), attention_mask=attention_mask, cache=None, **extra)
            losses.append(masked_mse(out, target, attention_mask))
        per_layer = torch.stack(losses)
        return TransferLoss(per_layer.mean(), per_layer)


@torch.no_grad()
def evaluate_transfer(transfer: AttentionTransfer, loader, accelerator, max_batches: int = 0) -> list[float]:
    """The MSE of each transferred layer over `loader` (this process's shard, at most `max_batches` batches; 0:
    all), weighted by examples and summed over processes: one read-back at the end. Pass the module itself, not its
    DDP wrapper (shards may hold different numbers of batches)."""
    from attnzoo.training.loop import to_device

    total = torch.zeros(len(transfer.layers), device=accelerator.device, dtype=torch.float64)
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for index, batch in enumerate(loader):
        if max_batches and index >= max_batches:
            break
        batch = to_device(batch, accelerator)
        per_layer = transfer(batch["input_ids"], batch.get("attention_mask")).per_layer
        examples = batch["input_ids"].shape[0]
        total += per_layer.double() * examples
        count += examples
    total, count = accelerator.reduce(total, "sum"), accelerator.reduce(count, "sum")
    return (total / count.clamp(min=1)).tolist()
