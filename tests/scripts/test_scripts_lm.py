"""scripts/train_lm.py end to end: a plain text file, enwik8-64K-shaped data, imagenet64-style pixel LM, text-dataset
fine-tuning, exact resume (in process for every family; after SIGKILL of a launched run), 1 vs 2 processes. (The quick
start's command, `accelerate launch` with recipes/quickstart_lm.yaml, is run by tests/scripts/test_readme.py.)"""

import json
import math
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnzoo.tokenization import BYTE_LEVEL_VOCAB_SIZE
from attnzoo.training.image_data import PIXEL_START_TOKEN, PixelSequences, to_hwc_uint8
from attnzoo.training.metrics import summed_token_nats
from attnzoo.training.tracking import read_metrics
from tests.scripts_helpers import (
    FAMILIES,
    QUIET,
    TINY,
    accelerate_command,
    assert_identical_weights,
    copy_interrupted_run,
    english_text,
    launch,
    launched,
    load_script,
    max_weight_difference,
    results,
    run_script,
    script_env,
    tiny_model,
    weights,
    write_enwik8_zip,
    write_pixel_arrays,
)

SHORT = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--num_warmup_steps", "2",
         "--learning_rate", "3e-3", "--sample_tokens", "0", *QUIET]


#: The enwik8 path (the standard split, overlapping windows, test bits/dim, evaluate.py reading the run's data
#: arguments) is the same for every family; every family trains through train_lm.py and is scored by evaluate.py in
#: test_imagenet64_style_pixel_lm_from_npz and test_resume_from_a_checkpoint_gives_identical_weights below. The
#: Reformer is the family whose paper trains on enwik8.
ENWIK8_FAMILIES = ("reformer",)


@pytest.mark.parametrize("family", ENWIK8_FAMILIES)
def test_enwik8_split_blocks_and_test_bits_per_dim(tmp_path, family):
    write_enwik8_zip(tmp_path / "data", num_bytes=60_000)
    out = tmp_path / "run"
    bpd = run_script("train_lm", ["--corpus", "enwik8", "--data_dir", tmp_path / "data", "--heldout_bytes", "2000",
                                  "--block_size", "64", "--train_stride", "32", "--max_train_steps", "12",
                                  "--logging_steps", "6", "--output_dir", out, *tiny_model(family), *SHORT])
    found = results(out)
    assert found["eval_bits_per_dim"] == bpd and found["family"] == family and found["train_steps"] == 12
    assert 0 < found["test_bits_per_dim"] < 8.5 and 0 < bpd < 8.5  # an untrained byte model is at ~8
    # 56,000 training bytes in 64-byte windows every 32 bytes (t2t's overlapping enwik8 windows)
    assert found["num_train_sequences"] == (56_000 - 64) // 32 + 1
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [6, 12]
    card = (out / "README.md").read_text()
    assert "bits_per_dim" in card and f"value: {round(found['test_bits_per_dim'], 4)}" in card
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == f"attnzoo_{family}"
    assert (out / "curves.png").stat().st_size > 1000
    # evaluate.py reads the data arguments from the run's training_args.json
    evaluated = run_script("evaluate", ["--model_name_or_path", out, "--split", "test"])
    assert evaluated["task"] == "lm" and evaluated["corpus"] == "enwik8"
    assert evaluated["bits_per_dim"] == pytest.approx(found["test_bits_per_dim"], rel=1e-6)


def test_enwik8_split_is_the_standard_byte_split(tmp_path):
    from attnzoo.training.text_data import TokenBlocks, read_enwik8, split_enwik8

    path = write_enwik8_zip(tmp_path, num_bytes=30_000)
    data = read_enwik8(path)
    assert bytes(data.numpy()) == english_text()[:30_000]
    splits = split_enwik8(data, heldout_bytes=5_000)
    assert [s.numel() for s in splits.values()] == [20_000, 5_000, 5_000]
    assert torch.equal(torch.cat(list(splits.values())), data)
    blocks = TokenBlocks(splits["train"], 1000, stride=250)
    assert len(blocks) == (20_000 - 1000) // 250 + 1
    assert torch.equal(blocks[1]["input_ids"], splits["train"][250:1250].long())
    with pytest.raises(ValueError, match="heldout_bytes"):
        split_enwik8(data, heldout_bytes=20_000)


def test_pixel_sequences_predict_every_sub_pixel():
    """[N, 3*S*S] planar rows become HWC images; each image is a start token + S*S*3 sub-pixels in raster order
    and every sub-pixel (the first one included) is a predicted token."""
    planar = np.arange(2 * 3 * 2 * 2).reshape(2, 12) % 256
    images = to_hwc_uint8(planar, 2)
    assert images.shape == (2, 2, 2, 3) and images[0, 0, 1].tolist() == [1, 5, 9]  # R, G, B of pixel (0, 1)
    item = PixelSequences(images)[1]
    assert item["input_ids"][0] == PIXEL_START_TOKEN and item["input_ids"][1:].tolist() == images[1].ravel().tolist()
    assert item["labels"][0] == -100
    from attnzoo.training.loop import new_model_config

    model = AutoModelForCausalLM.from_config(new_model_config("softmax", dict(vocab_size=257,
                                                                              max_position_embeddings=13), TINY_CFG))
    batch = {k: torch.stack([PixelSequences(images)[i][k] for i in range(2)]) for k in ("input_ids", "labels")}
    nats, count = summed_token_nats(model.eval(), batch)
    assert count == 2 * 12
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten(),
                                                 reduction="sum")
    torch.testing.assert_close(nats, expected, rtol=1e-5, atol=1e-4)


TINY_CFG = ["hidden_size=32", "num_hidden_layers=1", "num_attention_heads=2", "intermediate_size=64"]


@pytest.mark.parametrize("family", FAMILIES)
def test_imagenet64_style_pixel_lm_from_npz(tmp_path, family):
    train, validation = write_pixel_arrays(tmp_path / "npz", image_size=4)
    out = tmp_path / "run"
    bpd = run_script("train_lm", ["--corpus", "imagenet64", "--image_size", "4", "--train_file", train,
                                  "--validation_file", validation, "--max_train_steps", "8", "--output_dir", out,
                                  *tiny_model(family), *SHORT])
    found = results(out)
    assert found["sequence_length"] == 4 * 4 * 3 + 1 and found["image_size"] == 4
    assert 0 < bpd < 8.5
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == 257 and model.config.max_position_embeddings == 49
    evaluated = run_script("evaluate", ["--model_name_or_path", out, "--per_device_eval_batch_size", "2"])
    assert evaluated["bits_per_dim"] == pytest.approx(bpd, rel=1e-5) and evaluated["sequences"] == 6
    assert "unconditional-image-generation" in (out / "README.md").read_text()


def test_bf16_mixed_precision_run(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:4_000])
    out = tmp_path / "run"
    bpd = run_script("train_lm", ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "4",
                                  "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2",
                                  "--output_dir", out, *tiny_model("performer"), *SHORT])
    assert math.isfinite(bpd) and 0 < bpd < 9
    saved = weights(out)
    assert all(w.dtype == torch.float32 for w in saved.values() if w.is_floating_point()), \
        "mixed precision keeps float32 master weights"


def test_pixel_lm_from_an_image_folder(tmp_path):
    from PIL import Image

    for split, count in (("train", 8), ("val", 2)):
        (tmp_path / split / "any_class").mkdir(parents=True)
        for i in range(count):
            colour = (30 * i % 256, 200, 90)
            Image.new("RGB", (10, 7), colour).save(tmp_path / split / "any_class" / f"{i}.png")  # resized to 4x4
    out = tmp_path / "run"
    run_script("train_lm", ["--corpus", "imagenet64", "--image_size", "4", "--train_dir", tmp_path / "train",
                            "--validation_dir", tmp_path / "val", "--max_train_steps", "3", "--output_dir", out,
                            *tiny_model("softmax"), *SHORT])
    assert results(out)["sequence_length"] == 49


def test_fine_tunes_from_a_checkpoint_on_a_json_text_dataset(tmp_path):
    text = english_text()[:40_000].decode("utf-8", errors="ignore")
    paragraphs = [text[i: i + 500] for i in range(0, len(text), 500)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"body": p}) + "\n" for p in paragraphs[:-20]))
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps({"body": p}) + "\n" for p in paragraphs[-20:]))
    base = tmp_path / "base"
    first = run_script("train_lm", ["--train_file", tmp_path / "train.jsonl", "--validation_file",
                                    tmp_path / "valid.jsonl", "--text_column", "body", "--block_size", "64",
                                    "--max_train_steps", "15", "--output_dir", base, *tiny_model("performer"),
                                    *SHORT])
    tuned = tmp_path / "tuned"
    second = run_script("train_lm", ["--model_name_or_path", base, "--train_file", tmp_path / "train.jsonl",
                                     "--validation_file", tmp_path / "valid.jsonl", "--text_column", "body",
                                     "--block_size", "64", "--max_train_steps", "15", "--output_dir", tuned,
                                     "--num_warmup_steps", "2", "--sample_tokens", "0", *QUIET])
    assert results(tuned)["family"] == "performer"
    assert second < first, "fine-tuning the checkpoint must improve on it (it starts from its weights)"
    card = (tuned / "README.md").read_text()
    assert f"base_model: {base}" in card


def _resume_args(corpus, family, out, *extra):
    return ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "10", "--checkpointing_steps", "4",
            "--gradient_accumulation_steps", "3", "--heldout_fraction", "0.2", "--logging_steps", "2",
            "--max_eval_batches", "1", "--output_dir", out,
            *tiny_model(family, "hidden_dropout_prob=0.1", *extra), *SHORT]


@pytest.mark.parametrize("family,extra", [*((family, ()) for family in FAMILIES),
                                          ("performer", ("feature_redraw=interval", "feature_redraw_interval=3"))])
def test_resume_from_a_checkpoint_gives_identical_weights(tmp_path, family, extra):
    """Dropout, every family's random draws (Reformer's hash rotations, Performer's per-step features or its redraw
    counter buffer, RA's and LARA's samples), gradient accumulation with a partial last group, and an epoch boundary
    (33 sequences / batch 4 / 3 = 3 steps per epoch) between checkpoint and end: the resumed run must end
    bit-identical to the uninterrupted one."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:1350])
    run_script("train_lm", _resume_args(corpus, family, tmp_path / "full", *extra))
    resumed = tmp_path / "resumed"
    copy_interrupted_run(tmp_path / "full", resumed, 4)
    run_script("train_lm", [*_resume_args(corpus, family, resumed, *extra), "--resume_from_checkpoint", "latest"])
    assert_identical_weights(weights(tmp_path / "full"), weights(resumed))
    assert results(resumed)["eval_bits_per_dim"] == results(tmp_path / "full")["eval_bits_per_dim"]


def test_bad_arguments_say_what_to_change(tmp_path):
    base = ["--output_dir", tmp_path / "o", *SHORT]
    cases = [
        (["--corpus", "enwik8", "--data_dir", tmp_path], "enwik8 not found"),
        (["--corpus", "imagenet64"], "needs images"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size"),
        (["--model", "hidden_sise=32"], "hidden_sise"),
        (["--family", "nosuch"], "--family"),
        (["--mixed_precision", "fp16"], "bf16"),
        (["--max_train_steps", "0"], "max_train_steps"),
        (["--block_size", "100000", "--max_train_steps", "3"], "block_size"),
    ]
    for extra, message in cases:
        if message == "bf16" and torch.cuda.is_available():
            continue
        with pytest.raises(ValueError, match=message):
            run_script("train_lm", [*base, *extra])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rat: 0.1\n")
    with pytest.raises(ValueError, match="learning_rat"):
        run_script("train_lm", ["--recipe", recipe, *base])


#: The kill, the launcher and the checkpoint on disk are the same for every family; what a family adds is its own
#: random state: LSH's hash rotations drawn from the global RNG every training forward (reformer) and FAVOR+'s
#: feature redraws with their counter buffer in the model's state (performer). The Reformer's is killed here; the
#: Performer's launched run is stopped (SIGTERM, to the process group and to the launcher) and resumed to identical
#: weights in tests/scripts/test_training_faults.py, which saves and restores the same state in the same checkpoint
#: files. Every family's resume from a checkpoint (dropout, RA's and LARA's samples, the hybrid's features) is checked
#: bit-exactly by test_resume_from_a_checkpoint_gives_identical_weights above, in process.
KILLED_RUN_FAMILIES = ("reformer",)


@pytest.mark.slow
@pytest.mark.parametrize("family", KILLED_RUN_FAMILIES)
def test_killed_run_resumes_from_its_last_checkpoint_to_identical_weights(tmp_path, family):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:40_000])
    args = ["--train_file", corpus, "--block_size", "64", "--max_train_steps", "30", "--checkpointing_steps", "5",
            "--per_device_train_batch_size", "8", *tiny_model(family, "hidden_dropout_prob=0.1"),
            "--max_eval_batches", "2", "--num_warmup_steps", "2", "--sample_tokens", "0", "--cpu_threads", "1",
            *QUIET]
    # The reference runs in the same kind of process (thread count, hence float summation order) as the killed one,
    # beside the killed and the resumed runs: one thread each, so that two of them share two cores without waiting
    # on each other's threads.
    with launched("train_lm", [*args, "--output_dir", tmp_path / "full"]) as reference:
        killed = tmp_path / "killed"
        process = subprocess.Popen(accelerate_command("train_lm", [*args, "--output_dir", killed]), env=script_env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 300
        while not (killed / "checkpoints" / "step_10").is_dir() and process.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        import os

        os.killpg(process.pid, signal.SIGKILL)  # the launcher and the training process, mid-run
        process.wait()
        assert not (killed / "model.safetensors").exists(), "the run finished before it could be killed"
        done = launch("train_lm", [*args, "--output_dir", killed, "--resume_from_checkpoint", "latest"])
        assert "resumed from" in done.stdout
        reference.wait()
    assert_identical_weights(weights(tmp_path / "full"), weights(killed))


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_doubled_batch(tmp_path):
    """DDP over gloo (accelerate launch --multi_gpu --num_processes 2) with a reversible model: same data order, same
    gradients (mean over both shards), same schedule, so the weights agree to float rounding."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:8_000])
    args = ["--train_file", corpus, "--block_size", "32", "--max_train_steps", "6", "--heldout_fraction", "0.1",
            "--logging_steps", "3", *tiny_model("softmax", "hidden_dropout_prob=0.0", "reversible=true"),
            "--num_warmup_steps", "2", "--sample_tokens", "0", "--per_device_eval_batch_size", "4",
            "--cpu_threads", "1", *QUIET]  # one thread a process: the three processes share two cores
    with launched("train_lm", [*args, "--per_device_train_batch_size", "8", "--output_dir", tmp_path / "one"]) as one:
        two = launch("train_lm", [*args, "--per_device_train_batch_size", "4", "--output_dir", tmp_path / "two"],
                     num_processes=2)  # beside the one-process run
        one.wait()
    assert "2 process(es)" in two.stdout
    one_weights, two_weights = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert max_weight_difference(one_weights, two_weights) < 1e-5
    # The same initial weights the script builds (set_seed, then the model): training moved them by far more than
    # the tolerance, so agreement is not vacuous.
    from accelerate.utils import set_seed

    from attnzoo.training.loop import new_model_config

    set_seed(0)
    config = new_model_config("softmax", dict(vocab_size=BYTE_LEVEL_VOCAB_SIZE, max_position_embeddings=32,
                                              is_decoder=True),
                              [*TINY, "hidden_dropout_prob=0.0", "reversible=true"])
    initial = AutoModelForCausalLM.from_config(config).state_dict()
    assert max_weight_difference({k: initial[k] for k in one_weights}, one_weights) > 1e-3
    assert results(tmp_path / "two")["num_processes"] == 2
    assert math.isclose(results(tmp_path / "one")["eval_bits_per_dim"],
                        results(tmp_path / "two")["eval_bits_per_dim"], rel_tol=1e-5)


# -- a plain text file, in process and through accelerate launch --------------------------------------------------
@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    return path


TEXT_TINY = ["--model", "hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2", "intermediate_size=64",
        "--block_size", "32", "--per_device_train_batch_size", "4", "--num_warmup_steps", "2",
        "--sample_tokens", "0"]


@pytest.mark.parametrize("extra", [[], ["--model", "reversible=true", "hidden_size=32", "num_hidden_layers=2",
                                         "num_attention_heads=2", "intermediate_size=64"]])
def test_trains_reports_bits_per_dim_and_saves_a_loadable_model(text_file, tmp_path, extra):
    out = tmp_path / "run"
    bpd = load_script("train_lm").main(["--train_file", str(text_file), "--output_dir", str(out),
                                        "--max_train_steps", "30", "--learning_rate", "3e-3", *TEXT_TINY, *extra])
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
        script.main(["--train_file", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "o"), *TEXT_TINY])
    with pytest.raises(ValueError, match="num_attention_heads"):
        script.main(["--train_file", str(text_file), "--output_dir", str(tmp_path / "o"), *TEXT_TINY,
                     "--model", "hidden_size=30", "num_attention_heads=4"])


def test_passkey_fraction_mixes_retrieval_sequences_into_language_model_training(text_file, tmp_path):
    script = load_script("train_lm")
    out = tmp_path / "run"
    tiny = [a if a != "32" else "128" for a in TEXT_TINY]  # passkey sequences need room for a key and a question
    script.main(["--train_file", str(text_file), "--output_dir", str(out), "--max_train_steps", "2",
                 "--passkey_fraction", "0.25", *tiny])
    results = json.loads((out / "all_results.json").read_text())
    text_blocks = len("The quick brown fox jumps over the lazy dog. " * 400) * 95 // 100 // 128
    assert results["num_passkey_sequences"] == round(text_blocks / 3)  # a quarter of all training sequences
    assert results["num_train_sequences"] == text_blocks + results["num_passkey_sequences"]
    for bad, message in (("1.0", "--passkey_fraction=1.0"), ("-0.1", "--passkey_fraction=-0.1")):
        with pytest.raises(ValueError, match=message):
            script.main(["--train_file", str(text_file), "--output_dir", str(tmp_path / "bad"),
                         "--passkey_fraction", bad, *tiny])
    assert not (tmp_path / "bad").exists()
