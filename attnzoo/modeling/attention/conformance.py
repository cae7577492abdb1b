"""The far-part contract, checked: what every registered far part (and a user's, by calling `check_far_part`) must
satisfy for its windowed layer to be right, so that a new far part needs no tests of its own.

For a windowed attention kind (`"<name>_window"`, or "window", which has no far part), in float64 on a small
grouped-query rotary model with a left-padded batch:

1. `fast_equals_reference`: the layer's forward (the blocked or fused near part, the far part's `parallel`) equals
   its `reference_forward` (dense masks, the far part's `reference`) in values and in the gradients of the input and
   every parameter;
2. `decoding_equals_full_forward`: a 2-layer decoder's logits decoded token by token from its cache (the far part's
   `step`) equal its full forward;
3. `padding_changes_nothing`: a left-padded row's logits equal the same tokens alone;
4. `remote_code_round_trip`: a saved checkpoint loads with `trust_remote_code=True` where attnzoo is not installed
   (the code it carries) and gives the same logits;
5. `wrong_shapes_are_named`: a far part returning a triple of the wrong shape is refused with a ValueError that
   names it, in each form.

    from attnzoo.modeling.attention.conformance import check_far_part
    check_far_part("myfar_window")           # after the module that registers it is imported

tests/attention/test_far_part_conformance.py runs these over the whole registry.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from attnzoo.modeling.attention.base import ATTENTION_REGISTRY, Recomputation, UsesRecomputation, build_attention
from attnzoo.modeling.attention.windowed import FarOutput
from attnzoo.transformers_compat import output_cache

#: the small model every check builds (far-part settings of every family, kept small)
SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
             position_embedding_type="rotary", num_random_features=16, lara_chunk_size=3, lara_num_samples=2,
             lsh_chunk_length=4, lsh_num_buckets=4, lsh_num_hashes=2, lsh_full_attention_threshold=0,
             attention_head_size=None, is_decoder=True, vocab_size=37, num_hidden_layers=2, intermediate_size=48,
             hidden_dropout_prob=0.0, pad_token_id=0, max_position_embeddings=64, block_size=2, block_topk=2)
TOLERANCE = dict(rtol=1e-9, atol=1e-11)


def conformance_config(kind: str, **settings):
    from attnzoo.configuration.hybrid import ZooHybridConfig

    return ZooHybridConfig(**{**SMALL, **settings, "attn_layers": [kind]})


def _layer(kind, settings):
    torch.manual_seed(0)
    layer = build_attention(kind, conformance_config(kind, **settings), 0, True).double().eval()
    if hasattr(layer, "init_buffers"):
        layer.init_buffers()
    return layer


def _model(kind, settings):
    from attnzoo.modeling.modeling_hybrid import ZooHybridForCausalLM

    torch.manual_seed(0)
    return ZooHybridForCausalLM(conformance_config(kind, **settings)).double().eval()


def _padded_batch(length: int = 19, left: int = 5):
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :left] = 0
    ids = torch.randint(1, SMALL["vocab_size"], (2, length), generator=torch.Generator().manual_seed(2))
    return ids.masked_fill(mask == 0, 0), mask


def fast_equals_reference(kind: str, **settings) -> None:
    layer = _layer(kind, settings)
    mask = _padded_batch()[1].bool()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    x = torch.randn(2, mask.shape[1], SMALL["hidden_size"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1), requires_grad=True)
    kwargs = dict(attention_mask=mask, position_ids=positions)
    if isinstance(layer, UsesRecomputation):  # the reference replays the forward's draws (LSH's buckets)
        record = Recomputation()
        fast = layer(x, recompute=record, **kwargs)
        record.replaying = True
        reference = layer.reference_forward(x, recompute=record, **kwargs)
    else:
        fast, reference = layer(x, **kwargs), layer.reference_forward(x, **kwargs)
    torch.testing.assert_close(fast[mask], reference[mask], **TOLERANCE, msg=lambda m: f"{kind} values: {m}")
    weights = torch.randn(fast.shape, dtype=fast.dtype, generator=torch.Generator().manual_seed(3))
    weights = weights * mask[..., None]
    leaves = [x, *(p for p in layer.parameters() if p.requires_grad)]
    grads = [torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True, retain_graph=True)
             for out in (fast, reference)]
    names = ["input", *(n for n, p in layer.named_parameters() if p.requires_grad)]
    for name, a, b in zip(names, *grads, strict=True):
        if a is None or b is None:
            assert a is None and b is None, f"{kind}: {name} has a gradient in one form only"
            continue
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=lambda m, name=name: f"{kind} d{name}: {m}")


def decoding_equals_full_forward(kind: str, **settings) -> None:
    model = _model(kind, settings)
    ids, mask = _padded_batch(24, 3)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
        steps = [out.logits]
        for t in range(7, ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
            steps.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], **TOLERANCE,
                               msg=lambda m: f"{kind} decoding: {m}")


def padding_changes_nothing(kind: str, **settings) -> None:
    model = _model(kind, settings)
    ids, mask = _padded_batch(19, 5)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits[1, 5:]
        alone = model(ids[1:, 5:]).logits[0]
    torch.testing.assert_close(batch, alone, **TOLERANCE, msg=lambda m: f"{kind} left padding: {m}")


REMOTE_LOAD = """
import json, sys
sys.modules["attnzoo"] = None  # as if attnzoo were not installed: each checkpoint's own code must carry it
import torch
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[1]))
logits = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).double().eval()
    with torch.no_grad():
        logits[folder] = model(ids).logits.tolist()
print(json.dumps(logits))
"""


def remote_code_round_trip(kind: str, folder: str | Path | None = None, **settings) -> None:
    remote_code_round_trips([(kind, settings)], folder)


def remote_code_round_trips(cases: list[tuple[str, dict]], folder: str | Path | None = None) -> None:
    """`remote_code_round_trip` for several (kind, settings) at once: one process loads every checkpoint."""
    ids = _padded_batch(12, 0)[0]
    models = {f"{kind}-{index}": (kind, _model(kind, settings)) for index, (kind, settings) in enumerate(cases)}
    with tempfile.TemporaryDirectory() as scratch:
        targets = {name: Path(folder or scratch) / name for name in models}
        for name, (_, model) in models.items():
            model.save_pretrained(targets[name])
        done = subprocess.run([sys.executable, "-c", REMOTE_LOAD, json.dumps(ids.tolist()),
                               *map(str, targets.values())], capture_output=True, text=True)
        if done.returncode != 0:
            raise AssertionError(f"{[kind for kind, _ in cases]}: a saved checkpoint does not load from its own "
                                 f"code:\n{done.stderr[-2000:]}")
        loaded = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (kind, model) in models.items():
        with torch.no_grad():
            expected = model(ids).logits
        torch.testing.assert_close(torch.tensor(loaded[str(targets[name])], dtype=torch.float64), expected,
                                   **TOLERANCE, msg=lambda m, kind=kind: f"{kind} through remote code: {m}")


def wrong_shapes_are_named(kind: str, **settings) -> None:
    far_part_class = getattr(ATTENTION_REGISTRY[kind], "far_part_class", None)
    if far_part_class is None:
        return  # no far part: nothing to misshape
    for form in ("parallel", "step", "reference"):
        original = getattr(far_part_class, form)

        def misshapen(self, *args, original=original, **kwargs):
            out = FarOutput(*original(self, *args, **kwargs))  # a plain triple too
            return out._replace(den=out.den[..., :1, :])

        setattr(far_part_class, form, misshapen)
        try:
            model = _model(kind, settings)
            ids, mask = _padded_batch(12, 0)
            with torch.no_grad():
                try:
                    if form == "parallel":
                        model(ids)
                    elif form == "reference":
                        layer = model.model.transformer.blocks[0].attn
                        x = torch.randn(1, 12, SMALL["hidden_size"], dtype=torch.float64)
                        layer.reference_forward(x, recompute=Recomputation()) if isinstance(
                            layer, UsesRecomputation) else layer.reference_forward(x)
                    else:
                        setattr(far_part_class, form, original)  # the prefill runs the parallel form
                        out = model(ids[:, :6], use_cache=True)
                        setattr(far_part_class, form, misshapen)
                        model(ids[:, 6:7], cache=output_cache(out), use_cache=True)
                except ValueError as error:
                    if far_part_class.__name__ not in str(error) or f"{form}()" not in str(error):
                        raise AssertionError(f"{kind}: the refusal of a misshapen {form}() does not name the far "
                                             f"part and the form: {error}") from error
                else:
                    raise AssertionError(f"{kind}: a misshapen {form}() triple was not refused")
        finally:
            setattr(far_part_class, form, original)


CHECKS = {"fast_equals_reference": fast_equals_reference, "decoding_equals_full_forward": decoding_equals_full_forward,
          "padding_changes_nothing": padding_changes_nothing, "remote_code_round_trip": remote_code_round_trip,
          "wrong_shapes_are_named": wrong_shapes_are_named}


def check_far_part(kind: str, **settings) -> None:
    """Every check of the module docstring for the windowed attention `kind` (registered; `settings`: config
    values beyond `SMALL`); an AssertionError names the kind and the check that failed."""
    if kind not in ATTENTION_REGISTRY:
        raise ValueError(f"kind={kind!r} is not a registered attention: import the module that registers it first.")
    for check in CHECKS.values():
        check(kind, **settings)
