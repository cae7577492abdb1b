"""The Hugging Face workflow a new user brings, through public APIs only: checkpoints that load without importing
(or installing) attnzoo, the Trainer with gradient accumulation and metrics, collators, pipelines, the tokenizer's
special tokens, older checkpoints, and the fine-tuning script. Per-family conventions (meta device, export,
deterministic evaluation, assisted decoding) are in `family_suite.py`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    pipeline,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

import attnzoo
from attnzoo.tokenization import BYTE_LEVEL_VOCAB_SIZE, byte_level_tokenizer
from tests.attention.helpers import named
from tests.family_suite import AUTO
from tests.models import (
    test_family_lara,
    test_family_performer,
    test_family_ra,
    test_family_reformer,
    test_family_softmax,
)
from tests.scripts_helpers import ROOT, load_script

# The family suites' model builders (imported as modules, so pytest does not collect their tests here again).
SUITES = {"softmax": test_family_softmax.TestSoftmaxFamily(), "reformer": test_family_reformer.TestReformerFamily(),
          "performer": test_family_performer.TestPerformerFamily(), "ra": test_family_ra.TestRAFamily(),
          "lara": test_family_lara.TestLARAFamily()}


def tiny_lm(family: str, **overrides):
    values = dict(vocab_size=BYTE_LEVEL_VOCAB_SIZE, pad_token_id=256, bos_token_id=257, eos_token_id=258)
    values.update(overrides)
    return SUITES[family].build("ForCausalLM", **values).eval()


# -- 1. checkpoints load with transformers alone ------------------------------------------------------------------
def test_checkpoints_load_with_trust_remote_code_where_attnzoo_is_not_installed(tmp_path):
    """Every family (causal LM), and every head of one family, saved with save_pretrained, loads in a fresh process
    in which `import attnzoo` fails, with identical outputs; the tokenizer and pipeline() load too."""
    expected = {}
    cases = [(family, "ForCausalLM") for family in SUITES] + [("performer", head) for head in AUTO
                                                              if head != "ForCausalLM"]
    for family, head in cases:
        suite = SUITES[family]
        model = suite.build(head).eval()
        inputs = suite.inputs_for(head)
        folder = tmp_path / f"{family}-{head}"
        model.save_pretrained(folder)
        torch.save(inputs, folder / "inputs.pt")
        with torch.no_grad():
            expected[str(folder)] = (AUTO[head].__name__, suite.main_output(model(**inputs)))
    lm_folder = tmp_path / "byte-lm"
    tiny_lm("reformer").save_pretrained(lm_folder)
    byte_level_tokenizer(128).save_pretrained(lm_folder)
    torch.save({k: v for k, (_, v) in expected.items()}, tmp_path / "expected.pt")
    script = f"""
import json, sys
sys.modules["attnzoo"] = None  # as if attnzoo were not installed
import torch, transformers
torch.set_num_threads({torch.get_num_threads()})  # the same reduction order as the expected outputs
expected = torch.load({str(tmp_path / "expected.pt")!r})
auto = {json.dumps({k: name for k, (name, _) in expected.items()})}
worst = 0.0
for folder, auto_name in auto.items():
    model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True).eval()
    assert "attnzoo" not in type(model).__module__, type(model).__module__
    with torch.no_grad():
        out = model(**torch.load(folder + "/inputs.pt"))
    got = out.logits if hasattr(out, "logits") else out.last_hidden_state
    worst = max(worst, (got - expected[folder]).abs().max().item())
folder = {str(lm_folder)!r}
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
generator = transformers.pipeline("text-generation", model=folder, trust_remote_code=True)
text = generator("The ", max_new_tokens=4, do_sample=False)[0]["generated_text"]
print(json.dumps({{"worst": worst, "vocab": len(tokenizer), "text": text}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["worst"] == 0.0
    assert result["vocab"] == BYTE_LEVEL_VOCAB_SIZE and result["text"].startswith("The ")


def test_a_heads_backbone_saved_alone_loads_without_attnzoo(tmp_path):
    """Every family: the backbone of a causal LM and of an image classifier, saved on its own, loads through its
    remote code where attnzoo is not installed, with the same hidden states."""
    expected = {}
    for family, suite in SUITES.items():
        for head in ("ForCausalLM", "ForImageClassification"):
            backbone = suite.build(head).eval().base_model
            inputs = suite.inputs_for(head)
            folder = tmp_path / f"{family}-{head}"
            backbone.save_pretrained(folder)
            torch.save(inputs, folder / "inputs.pt")
            with torch.no_grad():
                expected[str(folder)] = backbone(**inputs).last_hidden_state
    torch.save(expected, tmp_path / "expected.pt")
    script = f"""
import json, sys
sys.modules["attnzoo"] = None  # as if attnzoo were not installed
import torch, transformers
torch.set_num_threads({torch.get_num_threads()})
expected = torch.load({str(tmp_path / "expected.pt")!r})
worst, classes = 0.0, set()
for folder, hidden in expected.items():
    model = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    assert "attnzoo" not in type(model).__module__, type(model).__module__
    classes.add(type(model).__name__)
    with torch.no_grad():
        got = model(**torch.load(folder + "/inputs.pt")).last_hidden_state
    worst = max(worst, (got - hidden).abs().max().item())
print(json.dumps({{"worst": worst, "classes": sorted(classes)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["worst"] == 0.0
    assert result["classes"] == sorted(suite.prefix + "Model" for suite in SUITES.values())


def test_loading_without_trust_remote_code_says_how(tmp_path):
    tiny_lm("softmax").save_pretrained(tmp_path)
    script = ("import sys; sys.modules['attnzoo'] = None\n"
              "from transformers import AutoModelForCausalLM\n"
              f"AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "trust_remote_code=True" in done.stderr


def test_a_config_saved_alone_carries_its_code(tmp_path):
    config = attnzoo.ZooLARAConfig(hidden_size=32, num_attention_heads=2)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == {"AutoConfig": "configuration_attnzoo.ZooLARAConfig"}
    assert (tmp_path / "configuration_attnzoo.py").is_file() and (tmp_path / "configuration_lara.py").is_file()
    assert not (tmp_path / "modeling_attnzoo.py").exists()


# -- 2, 3. the Trainer ---------------------------------------------------------------------------------------------
def train(model_fn, examples, collator, tmp_path, batch, accumulation, metrics=None, eval_examples=None):
    torch.manual_seed(0)
    model = model_fn()
    args = TrainingArguments(output_dir=str(tmp_path / f"run-{batch}-{accumulation}"), max_steps=2,
                             per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, data_seed=0, per_device_eval_batch_size=2, disable_tqdm=True,
                             optim="sgd")  # plain SGD: weights move linearly in the gradients, so they compare
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=collator,
                      eval_dataset=eval_examples, compute_metrics=metrics)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_accumulation_equals_one_batch(model_fn, examples, collator, tmp_path):
    _, big_losses, big_weights = train(model_fn, examples, collator, tmp_path, batch=4, accumulation=1)
    _, acc_losses, acc_weights = train(model_fn, examples, collator, tmp_path, batch=2, accumulation=2)
    np.testing.assert_allclose(acc_losses, big_losses, rtol=1e-4)
    for name, weight in big_weights.items():
        torch.testing.assert_close(acc_weights[name], weight, rtol=1e-4, atol=1e-5, msg=named(name))


def lm_examples(lengths=(5, 12, 7, 16, 9, 14, 6, 11)):
    """Lengths differ, so the two micro-batches of a step hold different numbers of labelled tokens."""
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in lengths]


@pytest.mark.parametrize("family,overrides", [("softmax", {}), ("softmax", {"loss_chunk_size": 4}),
                                              ("performer", {"feature_redraw": "fixed"}),
                                              ("lara", {"sample_noise_std": 0.0})])
def test_trainer_gradient_accumulation_equals_one_large_batch_causal_lm(family, overrides, tmp_path):
    collator = DataCollatorForLanguageModeling(byte_level_tokenizer(64), mlm=False)
    assert_accumulation_equals_one_batch(lambda: tiny_lm(family, **overrides).train(), lm_examples(), collator,
                                         tmp_path)


def test_trainer_gradient_accumulation_equals_one_large_batch_masked_lm_and_seq2seq(tmp_path):
    tokenizer = byte_level_tokenizer(64)
    masked = []
    for i, example in enumerate(lm_examples()):  # fixed masks, so both runs see the same labels
        ids = list(example["input_ids"])
        labels = [-100] * len(ids)
        for position in range(i % 3, len(ids), 3):
            labels[position], ids[position] = ids[position], tokenizer.mask_token_id
        masked.append({"input_ids": ids, "labels": labels})
    assert_accumulation_equals_one_batch(
        lambda: SUITES["softmax"].build("ForMaskedLM", vocab_size=BYTE_LEVEL_VOCAB_SIZE, pad_token_id=256),
        masked, DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100), tmp_path / "mlm")
    pairs = [{"input_ids": e["input_ids"], "labels": e["input_ids"][: 3 + i % 5]} for i, e in enumerate(lm_examples())]
    assert_accumulation_equals_one_batch(
        lambda: SUITES["softmax"].build("ForConditionalGeneration", vocab_size=BYTE_LEVEL_VOCAB_SIZE,
                                        pad_token_id=256, decoder_start_token_id=257),
        pairs, DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100), tmp_path / "seq2seq")


def test_trainer_evaluation_gets_logits_with_the_chunked_loss(tmp_path):
    seen = {}

    def metrics(prediction):
        seen["shape"] = prediction.predictions.shape
        return {"accuracy": float((prediction.predictions.argmax(-1)[:, :-1] == prediction.label_ids[:, 1:]).mean())}

    collator = DataCollatorForLanguageModeling(byte_level_tokenizer(64), mlm=False)
    trainer, _, _ = train(lambda: tiny_lm("performer", loss_chunk_size=4).train(), lm_examples(), collator,
                          tmp_path, batch=2, accumulation=1, metrics=metrics, eval_examples=lm_examples()[:4])
    result = trainer.evaluate()
    assert "eval_accuracy" in result and np.isfinite(result["eval_loss"])
    assert seen["shape"][-1] == BYTE_LEVEL_VOCAB_SIZE
    # The memory saving stays in training: no logits there.
    model = trainer.model.train()
    batch = collator(lm_examples()[:2])
    assert model(**batch).logits is None


# -- 4. tokenizer, collators, pipelines ----------------------------------------------------------------------------
def test_byte_tokenizer_special_tokens_collators_and_truncation():
    tokenizer = byte_level_tokenizer(32)
    assert tokenizer("Az").input_ids == [65, 122]  # a byte is its own id
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id,
            tokenizer.mask_token_id] == [256, 257, 258, 259, 260]
    assert len(tokenizer("x" * 100, truncation=True).input_ids) == 32
    for mlm in (False, True):
        batch = DataCollatorForLanguageModeling(tokenizer, mlm=mlm)([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
        assert batch["input_ids"].shape == (2, 3) and (batch["labels"] == -100).any()
    assert tokenizer.decode([72, 105, 258], skip_special_tokens=True) == "Hi"


def test_generate_stops_at_the_end_of_text_and_batched_pipelines_pad(tmp_path):
    model = tiny_lm("performer")
    with torch.no_grad():  # make </s> the most likely next token everywhere: the output is its (long) embedding
        model.lm_head.weight[258] *= 100.0
        final_norm = model.model.transformer.final_norm
        final_norm.weight.zero_()
        final_norm.bias.copy_(model.lm_head.weight[258] / model.lm_head.weight[258].norm())
    model.save_pretrained(tmp_path)
    byte_level_tokenizer(128).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["eos_token_id"] == 258 and saved["pad_token_id"] == 256
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    out = loaded.generate(torch.tensor([[72, 105]]), max_new_tokens=20, do_sample=False)
    assert out.shape[1] < 22 and out[0, -1] == 258
    generator = pipeline("text-generation", model=str(tmp_path))
    results = generator(["Hello", "A"], max_new_tokens=3, do_sample=False, batch_size=2)
    assert len(results) == 2


def test_fill_mask_pipeline_with_the_saved_tokenizer(tmp_path):
    model = SUITES["lara"].build("ForMaskedLM", vocab_size=BYTE_LEVEL_VOCAB_SIZE, pad_token_id=256)
    model.save_pretrained(tmp_path)
    byte_level_tokenizer(128).save_pretrained(tmp_path)
    assert isinstance(AutoModelForMaskedLM.from_pretrained(tmp_path), attnzoo.ZooLARAForMaskedLM)
    filled = pipeline("fill-mask", model=str(tmp_path))("Hel<mask>o")
    assert len(filled) == 5 and all("sequence" in f for f in filled)


def old_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The 256-token tokenizer checkpoints carried before the special tokens were added."""
    symbols = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={symbols[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=1 << 30)


def test_older_byte_level_checkpoints_still_load_generate_and_fine_tune(tmp_path):
    old = tmp_path / "old"
    SUITES["softmax"].build("ForCausalLM", vocab_size=256, pad_token_id=None).save_pretrained(old)
    old_byte_tokenizer().save_pretrained(old)
    config = json.loads((old / "config.json").read_text())
    config.pop("auto_map")  # as written before checkpoints carried their code
    (old / "config.json").write_text(json.dumps(config))
    for name in old.glob("*.py"):
        name.unlink()
    tokenizer = AutoTokenizer.from_pretrained(old)
    model = AutoModelForCausalLM.from_pretrained(old)
    assert len(tokenizer) == 256 and model.generate(tokenizer("Hi", return_tensors="pt").input_ids,
                                                    max_new_tokens=3, do_sample=False).shape == (1, 5)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some English text to fine-tune on. " * 200)
    train_lm = load_script("train_lm")
    train_lm.main(["--model_name_or_path", str(old), "--train_file", str(corpus), "--block_size", "32",
                   "--max_train_steps", "2", "--per_device_train_batch_size", "2", "--sample_tokens", "4",
                   "--report_to", "jsonl", "--output_dir", str(tmp_path / "tuned")])
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").config.vocab_size == 256


def test_image_classifier_saves_a_processor_the_pipeline_uses(tmp_path):
    from PIL import Image

    script = load_script("train_image_classification")
    model = SUITES["ra"].build("ForImageClassification", num_labels=3, id2label={0: "a", 1: "b", 2: "c"},
                               label2id={"a": 0, "b": 1, "c": 2})
    model.save_pretrained(tmp_path)
    args = script.build_parser().parse_args(["--image_size", "16", "--train_dir", str(tmp_path)])
    script.image_processor(args).save_pretrained(tmp_path)
    assert (tmp_path / "preprocessor_config.json").is_file()
    classify = pipeline("image-classification", model=str(tmp_path))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 20, 3), dtype=np.uint8))
    assert {r["label"] for r in classify(image)} == {"a", "b", "c"}


# -- 10. fine-tuning on a custom dataset ---------------------------------------------------------------------------
@pytest.mark.slow
def test_text_classification_script_fine_tunes_a_checkpoint_on_a_csv(tmp_path):
    base = tmp_path / "base"
    tiny_lm("reformer").save_pretrained(base)
    byte_level_tokenizer(128).save_pretrained(base)
    rows = ["text,label"] + [f"{'good great fine' if i % 2 else 'bad awful poor'} item {i},"
                             f"{'positive' if i % 2 else 'negative'}" for i in range(40)]
    (tmp_path / "data.csv").write_text("\n".join(rows))
    out = tmp_path / "classifier"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "finetune_text_classification.py"),
                           "--model_name_or_path", str(base), "--train_file", str(tmp_path / "data.csv"),
                           "--output_dir", str(out), "--num_train_epochs", "3", "--learning_rate", "3e-3",
                           "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
                           "--report_to", "none", "--save_strategy", "no", "--use_cpu", "--seed", "0"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.pooling == "last" and model.config.id2label == {0: "negative", 1: "positive"}
    predictions = pipeline("text-classification", model=str(out))(["good great fine", "bad awful poor"])
    assert {p["label"] for p in predictions} <= {"negative", "positive"}


# -- 5. evaluation scores repeat ----------------------------------------------------------------------------------
def test_evaluate_script_repeats_exactly_for_random_attentions(tmp_path):
    evaluate = load_script("evaluate")
    corpus = tmp_path / "text.txt"
    corpus.write_text("Reformer hashes, RA samples; evaluation must not. " * 80)
    scores = []
    for family in ("reformer", "ra"):
        folder = tmp_path / family
        tiny_lm(family, **({"ra_variant": "unbiased"} if family == "ra" else {})).save_pretrained(folder)
        byte_level_tokenizer(128).save_pretrained(folder)
        argv = ["--model_name_or_path", str(folder), "--train_file", str(corpus), "--block_size", "48"]
        scores.append([evaluate.main(argv)["bits_per_dim"] for _ in range(2)])
    for first, second in scores:
        assert first == second

