"""The Llama path end to end, as a user runs it: a transformers LlamaForCausalLM (grouped-query heads, rotary
positions) converted into a hybrid stack (FAVOR+ with a learnable projection, windowed FAVOR+, and an exact softmax
layer) by the converter's command, its attention transferred by scripts/transfer_attention.py, fine-tuned with LoRA
by scripts/train_lm.py under `accelerate launch`, then loaded with the Auto classes in a fresh process that never
imports attnzoo, where it generates what the in-process model computes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.scripts_helpers import ROOT, launch, save_tiny_llama, script_env

pytestmark = pytest.mark.slow

FRESH_PROCESS = """
import json, sys
sys.modules["attnzoo"] = None  # the checkpoint's own code must do everything
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
ids = tokenizer("The grammar of ", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=12, do_sample=False)
print(json.dumps({"class": type(model).__name__, "tokens": out[0].tolist(),
                  "logits": model(out).logits[0, -1].tolist()}))
"""


def test_convert_transfer_finetune_with_lora_and_load_in_a_fresh_process(tmp_path):
    source, converted = tmp_path / "source", tmp_path / "converted"
    transferred, finetuned = tmp_path / "transferred", tmp_path / "finetuned"
    save_tiny_llama(source, layers=3, positions=64)
    env = script_env()
    subprocess.run([sys.executable, "-m", "attnzoo.convert.llama", source, converted, "--family", "hybrid",
                    "--model", "attn_layers=[favor,favor_window,full]", "feature_redraw=learned",
                    "num_random_features=16", "window_size=8", "num_sink_tokens=2"],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    common = ["--block_size", 32, "--per_device_train_batch_size", 2, "--max_train_steps", 3, "--seed", 0]
    launch("transfer_attention", ["--teacher", source, "--student", converted, "--output_dir", transferred,
                                  *common])
    transfer = json.loads((transferred / "all_results.json").read_text())
    assert transfer["transferred_layers"] == [0, 1] and transfer["skipped_layers"] == [2]  # the softmax layer
    launch("train_lm", ["--model_name_or_path", transferred, "--output_dir", finetuned, "--lora_r", 4,
                        "--eval_steps", 3, "--sample_tokens", 0, *common])
    config = json.loads((finetuned / "config.json").read_text())
    assert config["model_type"] == "attnzoo_hybrid"
    assert config["attn_layers"] == ["favor", "favor_window", "full"] and config["num_key_value_heads"] == 2

    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(finetuned)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": ""}, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads(done.stdout.strip().splitlines()[-1])
    assert fresh["class"] == "ZooHybridForCausalLM"

    from transformers import AutoModelForCausalLM

    import attnzoo  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(finetuned).eval()
    tokens = torch.tensor([fresh["tokens"]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits[0, -1], torch.tensor(fresh["logits"]), rtol=1e-5, atol=1e-5)
        prompt_length = len(tokens[0]) - 12
        greedy = model.generate(tokens[:, :prompt_length], max_new_tokens=12, do_sample=False)
    assert greedy[0].tolist() == fresh["tokens"]
