"""scripts/train_lm.py end to end on a small local text file."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnzoo.training.tracking import read_metrics
from tests.scripts_helpers import ROOT, load_script


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    return path


TINY = ["--model", "hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2", "intermediate_size=64",
        "--block_size", "32", "--per_device_train_batch_size", "4", "--num_warmup_steps", "2",
        "--sample_tokens", "0"]


@pytest.mark.parametrize("extra", [[], ["--model", "reversible=true", "hidden_size=32", "num_hidden_layers=2",
                                         "num_attention_heads=2", "intermediate_size=64"]])
def test_trains_reports_bits_per_dim_and_saves_a_loadable_model(text_file, tmp_path, extra):
    out = tmp_path / "run"
    bpd = load_script("train_lm").main(["--train_file", str(text_file), "--output_dir", str(out),
                                        "--max_train_steps", "30", "--learning_rate", "3e-3", *TINY, *extra])
    results = json.loads((out / "all_results.json").read_text())
    assert results["eval_bits_per_dim"] == bpd and results["train_steps"] == 30
    assert bpd < 6.0, "30 steps on a repetitive text must beat an untrained byte model (~8 bits/dim)"
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The quick", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 5)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [25, 30]
    assert records[-1]["eval_bits_per_dim"] == bpd and "train_bits_per_dim" in records[0]


def test_bad_arguments_raise_value_error(text_file, tmp_path):
    script = load_script("train_lm")
    with pytest.raises(ValueError, match="does not exist"):
        script.main(["--train_file", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "o"), *TINY])
    with pytest.raises(ValueError, match="num_attention_heads"):
        script.main(["--train_file", str(text_file), "--output_dir", str(tmp_path / "o"), *TINY,
                     "--model", "hidden_size=30", "num_attention_heads=4"])


@pytest.mark.slow
def test_accelerate_launch_runs_the_quickstart_recipe_briefly(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "scripts" / "train_lm.py"),
           "--recipe", str(ROOT / "recipes" / "quickstart_lm.yaml"), "--max_train_steps", "5",
           "--max_eval_batches", "2", "--output_dir", str(tmp_path / "qs"), "--sample_tokens", "10"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out bits/dim" in done.stdout
    assert torch.isfinite(torch.tensor(json.loads((tmp_path / "qs" / "all_results.json").read_text())
                                       ["eval_bits_per_dim"]))
