"""A checkpoint saved under one transformers release loads and generates identically under another.

CI's two lanes install the newest releases and the supported floor (`.ci/run`); this script runs across them:

    FLOOR/bin/python tests/cross_version_check.py save DIR      # one lane saves a checkpoint per family
    NEWEST/bin/python tests/cross_version_check.py load DIR     # the other loads them, and the other way round

`save` writes a small causal LM of every family with its logits on a fixed batch and its greedy continuation (cached
decoding). `load` reads each checkpoint twice, with attnzoo importable (the registered Auto classes) and as remote
code in a process that cannot import attnzoo (`trust_remote_code=True`, the code the checkpoint carries), and checks
that the logits agree (up to the float rounding that two torch releases' kernels may differ by) and that greedy
decoding, cached and uncached, gives the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FAMILIES = {
    "softmax": {},
    "performer": {"attn_layers": ["favor"]},
    "ra": {},
    "lara": {},
    "reformer": {"attn_layers": ["local", "lsh"], "lsh_chunk_length": 8, "local_chunk_length": 4},
    "window": {"window_size": 4, "num_sink_tokens": 2},
    # Llama layers (rotary positions, grouped heads, RMSNorm, SwiGLU) with windowed FAVOR+ and softmax layers
    "hybrid": {"attn_layers": ["favor_window", "full"], "window_size": 4, "num_sink_tokens": 2,
               "position_embedding_type": "rotary", "num_key_value_heads": 1, "norm_type": "rmsnorm",
               "mlp_type": "gated", "hidden_act": "silu", "mlp_bias": False, "attention_bias": False},
}
SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64, pad_token_id=0, eos_token_id=None)
NEW_TOKENS = 12
#: logits may differ across torch releases by kernel rounding, never by more
LOGIT_TOLERANCE = 1e-5


def _inputs():
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, SIZES["vocab_size"], (2, 10), generator=generator)


def _outputs(model, ids) -> dict:
    import torch

    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    cached = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    uncached = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, use_cache=False)
    return {"logits": logits, "cached": cached, "uncached": uncached}


def save(folder: Path) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    import attnzoo  # noqa: F401  (registers the attnzoo_* model types)

    ids = _inputs()
    for family, extra in FAMILIES.items():
        torch.manual_seed(0)
        config = AutoConfig.for_model(f"attnzoo_{family}", **SIZES, **extra)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(folder / family)
        torch.save(_outputs(model, ids), folder / family / "expected.pt")
    (folder / "saved_with.json").write_text(json.dumps({"transformers": transformers.__version__,
                                                        "torch": torch.__version__}))


def _compare(folder: Path, remote_code: bool) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    problems = []
    ids = _inputs()
    for family in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(folder / family, trust_remote_code=remote_code).eval()
        module = type(model).__module__
        if remote_code == module.startswith("attnzoo"):
            problems.append(f"{family}: loaded {module}, expected {'remote' if remote_code else 'attnzoo'} code")
        expected, got = torch.load(folder / family / "expected.pt"), _outputs(model, ids)
        difference = (got["logits"] - expected["logits"]).abs().max().item()
        if difference > LOGIT_TOLERANCE:
            problems.append(f"{family}: logits differ by {difference:.3g}")
        for key in ("cached", "uncached"):
            if not torch.equal(got[key], expected[key]):
                problems.append(f"{family}: {key} greedy decoding differs")
        if not torch.equal(got["cached"], got["uncached"]):
            problems.append(f"{family}: cached and uncached decoding differ")
    return problems


def load(folder: Path) -> None:
    import torch
    import transformers

    import attnzoo  # noqa: F401

    saved = json.loads((folder / "saved_with.json").read_text())
    here = {"transformers": transformers.__version__, "torch": torch.__version__}
    problems = [f"[attnzoo] {p}" for p in _compare(folder, remote_code=False)]
    # remote code, in a process where attnzoo cannot be imported
    script = (f"import sys; sys.modules['attnzoo'] = None; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              f"import json, cross_version_check as c; from pathlib import Path\n"
              f"print(json.dumps(c._compare(Path({str(folder)!r}), remote_code=True)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if done.returncode != 0:
        problems.append(f"[remote code] failed: {done.stderr[-3000:]}")
    else:
        problems += [f"[remote code] {p}" for p in json.loads(done.stdout.strip().splitlines()[-1])]
    print(f"saved with {saved}, loaded with {here}: {len(FAMILIES)} families, "
          f"{'OK' if not problems else 'FAILED'}")
    for problem in problems:
        print("  " + problem)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "load"):
        sys.exit(__doc__)
    {"save": save, "load": load}[sys.argv[1]](Path(sys.argv[2]))
