"""--push_to_hub against a loopback stand-in for the Hub (tests/hub_server.py), then from_pretrained from it; the
pushed model card carries the measured metrics as model-index results."""

import json
import sys

import pytest
import yaml

from tests.hub_server import LocalHub
from tests.scripts_helpers import QUIET, ROOT, Started, english_text, launch, results, script_env, tiny_model

pytestmark = pytest.mark.slow


def card_metadata(text: str) -> dict:
    return yaml.safe_load(text.split("---")[1])


def test_push_to_hub_then_from_pretrained(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:6_000])
    out = tmp_path / "run"
    with LocalHub() as hub:
        # HF_ENDPOINT is read when huggingface_hub is imported: it is set in the subprocesses' environment.
        env = script_env(HF_ENDPOINT=hub.url, HF_TOKEN="test-token", HF_HUB_OFFLINE="0",
                         HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
        done = launch("train_lm", ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "4",
                                   "--per_device_train_batch_size", "4", "--num_warmup_steps", "1",
                                   "--sample_tokens", "0", "--output_dir", out, "--push_to_hub", "--hub_model_id",
                                   "tester/attnzoo-tiny-lm", "--checkpointing_steps", "2",
                                   *tiny_model("performer"), *QUIET], env=env)
        assert "pushed to the Hub" in done.stdout
        files = hub.files("tester/attnzoo-tiny-lm")
        assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "all_results.json",
                "curves.png", "metrics.jsonl", "training_args.json"} <= set(files)
        assert not any(name.startswith("checkpoints/") for name in files), "training state stays local"

        card = files["README.md"].decode()
        metadata = card_metadata(card)
        measured = results(out)["eval_bits_per_dim"]
        metric = metadata["model-index"][0]["results"][0]["metrics"][0]
        assert metric["type"] == "bits_per_dim" and metric["value"] == pytest.approx(measured, abs=1e-4)
        assert "attnzoo_performer" in metadata["tags"] and "max_train_steps: 4" in card

        # A Hub user without attnzoo: the repository's own code (auto_map, trust_remote_code) is all it needs.
        load = ("import sys, json\n"
                "sys.modules['attnzoo'] = None  # as if attnzoo were not installed\n"
                "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                "model = AutoModelForCausalLM.from_pretrained('tester/attnzoo-tiny-lm', trust_remote_code=True)\n"
                "tokenizer = AutoTokenizer.from_pretrained('tester/attnzoo-tiny-lm', trust_remote_code=True)\n"
                "ids = tokenizer('The ', return_tensors='pt').input_ids\n"
                "print(json.dumps({'type': model.config.model_type, 'vocab': len(tokenizer),\n"
                "                  'shape': list(model.generate(ids, max_new_tokens=3).shape)}))\n")
        # the two readers of the pushed repository run at once, each with a cache of its own
        loading = Started([sys.executable, "-c", load], env=env, cwd=ROOT)
        evaluating = Started([sys.executable, ROOT / "scripts" / "evaluate.py", "--model_name_or_path",
                              "tester/attnzoo-tiny-lm"], env={**env, "HF_HOME": str(tmp_path / "hf_home_2")}, cwd=ROOT)
        loaded, evaluated = loading.result(timeout=300), evaluating.result(timeout=300)
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        info = json.loads(loaded.stdout.strip().splitlines()[-1])
        assert info == {"type": "attnzoo_performer", "vocab": 261, "shape": [1, 7]}
        assert {"configuration_attnzoo.py", "modeling_attnzoo.py"} <= set(files)
        assert any(path.endswith("/resolve/" + hub.repos["tester/attnzoo-tiny-lm"].head + "/model.safetensors")
                   for _, path, status in hub.requests if status == 200)

        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        assert json.loads(evaluated.stdout[evaluated.stdout.index("{"):])["bits_per_dim"] == pytest.approx(measured)
