"""What every windowed attention computes, for the test that a rewrite of the windowed layers changes no output
(tests/attention/test_windowed_outputs_unchanged.py). `compute_outputs()` runs each kind in float64 on fixed seeds:
the fast path and the reference forward of one layer (left padding, rotary positions, grouped key/value heads), the
fast path's input gradient, and a 2-layer decoder's logits, full and decoded token by token from its cache.

    python -m tests.attention.windowed_outputs   # writes tests/attention/saved_outputs/windowed_outputs.pt

was run on the code before the rewrite (commit 1eeb7c8's windowed layers, first; then again with the weights saved
beside the outputs, on code that still matched those outputs to 1e-12). The file it wrote is the reference. The
weights travel with it, so the comparison does not depend on the order in which a rewritten layer creates its
parameters; their names must not change (a checkpoint saved before the rewrite loads into the layers after it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnzoo import ZooHybridConfig, ZooHybridForCausalLM
from attnzoo.modeling.attention import build_attention
from attnzoo.transformers_compat import output_cache

SAVED = Path(__file__).with_name("saved_outputs") / "windowed_outputs.pt"
#: each case: (attention kind, its settings beyond the shared ones)
CASES = {
    "window": ("window", {}),
    "favor_window": ("favor_window", {}),
    "favor_window_learned": ("favor_window", {"feature_redraw": "learned"}),
    "lara_window": ("lara_window", {}),
    "lara_window_query_weights": ("lara_window", {"lara_weighting": "query_specific"}),
    "ra_window": ("ra_window", {}),
    "ra_window_biased": ("ra_window", {"ra_variant": "biased"}),
    "lsh_window_bucket": ("lsh_window", {}),
    "lsh_window_chunk": ("lsh_window", {"lsh_attend_to": "chunk"}),
}
SHARED = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, window_size=4, num_sink_tokens=2,
              position_embedding_type="rotary", num_random_features=16, lara_chunk_size=3, lara_num_samples=2,
              lsh_chunk_length=4, lsh_num_buckets=4, lsh_num_hashes=2, lsh_full_attention_threshold=0,
              attention_head_size=None, is_decoder=True, vocab_size=37, num_hidden_layers=2, intermediate_size=48,
              hidden_dropout_prob=0.0, pad_token_id=0, max_position_embeddings=64)


def case_config(kind: str, settings: dict) -> ZooHybridConfig:
    return ZooHybridConfig(**{**SHARED, **settings, "attn_layers": [kind]})


def layer_outputs(kind: str, settings: dict, weights: dict | None = None) -> dict[str, torch.Tensor]:
    """The layer's outputs, with `weights` (a saved state dict) loaded when given; "layer_weights" holds the ones
    used."""
    torch.manual_seed(0)
    attn = build_attention(kind, case_config(kind, settings), 0, True).double().eval()
    if weights is not None:
        attn.load_state_dict(weights)
    elif hasattr(attn, "init_buffers"):
        attn.init_buffers()
    x = torch.randn(2, 19, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :5] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    real = mask[..., None]
    fast = attn(x, attention_mask=mask, position_ids=positions) * real
    reference = attn.reference_forward(x, attention_mask=mask, position_ids=positions) * real
    (gradient,) = torch.autograd.grad(fast.square().sum(), x)
    return {"fast": fast.detach(), "reference": reference.detach(), "gradient": gradient,
            "layer_weights": {name: t.detach().clone() for name, t in attn.state_dict().items()}}


def decoder_outputs(kind: str, settings: dict, weights: dict | None = None) -> dict[str, torch.Tensor]:
    """A 2-layer decoder's logits, with `weights` loaded when given; "model_weights" holds the ones used."""
    torch.manual_seed(0)
    model = ZooHybridForCausalLM(case_config(kind, settings)).double().eval()
    if weights is not None:
        model.load_state_dict(weights)
    ids = torch.randint(1, 37, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
        steps = [out.logits]
        for t in range(7, ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
            steps.append(out.logits)
    real = mask.bool()[..., None]
    return {"full_logits": full * real, "decoded_logits": torch.cat(steps, 1) * real,
            "model_weights": {name: t.detach().clone() for name, t in model.state_dict().items()}}


def compute_outputs() -> dict[str, dict[str, torch.Tensor]]:
    return {name: {**layer_outputs(kind, settings), **decoder_outputs(kind, settings)}
            for name, (kind, settings) in CASES.items()}


if __name__ == "__main__":
    SAVED.parent.mkdir(exist_ok=True)
    torch.save(compute_outputs(), SAVED)
    print(f"wrote {SAVED}")
