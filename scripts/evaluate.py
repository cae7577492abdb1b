"""Evaluate any saved or Hub checkpoint of the zoo: bits/dim (text and images), BLEU, or top-1 accuracy.

    python scripts/evaluate.py --model_name_or_path runs/quickstart
    python scripts/evaluate.py --model_name_or_path runs/enwik8 --split test --data_dir data/enwik8
    accelerate launch scripts/evaluate.py --model_name_or_path user/attnzoo-wmt14 --num_beams 4
    python scripts/evaluate.py --model_name_or_path runs/deit --validation_dir data/imagenet/val

The task follows from the checkpoint (encoder-decoder: translation; image classifier: top-1; otherwise causal LM:
bits/dim). Data arguments are those of the training script and default to the values the run was trained with
(training_args.json beside the weights), so a run folder evaluates with no other argument; any data argument of the
training script can be given to change them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoConfig

import attnzoo  # noqa: F401  (registers the families with the Auto classes)
from attnzoo.training.loop import eval_loader
from attnzoo.training.metrics import evaluate_bits_per_dim, evaluate_top1
from attnzoo.training.model_source import reading_model_source
from attnzoo.training.publish import ARGS_FILE

SCRIPTS = Path(__file__).resolve().parent
TASK_SCRIPTS = {"lm": "train_lm", "translation": "train_translation",
                "image_classification": "train_image_classification"}
# Training arguments that describe the run, not the data: never taken from training_args.json.
NOT_DATA = {"model_name_or_path", "model", "family", "output_dir", "resume_from_checkpoint", "push_to_hub",
            "hub_model_id", "hub_token", "recipe", "per_device_eval_batch_size", "max_eval_batches",
            "mixed_precision", "num_beams", "length_penalty", "max_train_steps", "report_to"}


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: "--model" (a training-script argument) must not be read as --model_name_or_path.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--model_name_or_path", required=True, help="a run folder or a Hub id")
    parser.add_argument("--task", default="auto", choices=["auto", *TASK_SCRIPTS])
    parser.add_argument("--split", default="validation", choices=["validation", "test"])
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--max_eval_batches", type=int, default=0, help="per process (0: all)")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--num_beams", type=int, default=None, help="translation (default: generation_config)")
    parser.add_argument("--length_penalty", type=float, default=None)
    parser.add_argument("--output_file", default=None, help="also write the results as JSON here")
    return parser


def load_script(name: str):
    """The training script module (its data pipeline is the one the checkpoint was trained with)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def detect_task(config) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "translation"
    if any("ImageClassification" in a for a in (config.architectures or [])):
        return "image_classification"
    return "lm"


def saved_training_arguments(model_name_or_path: str) -> dict:
    """training_args.json of the run (local folder or Hub repository), or {} when there is none."""
    local = Path(model_name_or_path) / ARGS_FILE
    if local.is_file():
        return json.loads(local.read_text())
    if Path(model_name_or_path).exists():
        return {}
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model_name_or_path, ARGS_FILE)).read_text())
    except Exception:  # noqa: BLE001  (an upload without the file, or no access: use the script's defaults)
        return {}


def data_arguments(script, model_name_or_path: str, rest: list[str]) -> argparse.Namespace:
    parser = script.build_parser()
    known = {action.dest for action in parser._actions}
    saved = {k: v for k, v in saved_training_arguments(model_name_or_path).items() if k in known and k not in NOT_DATA}
    parser.set_defaults(**saved)
    return parser.parse_args([*rest, "--model_name_or_path", model_name_or_path])


def evaluate_lm(script, args, data, model, accelerator) -> dict:
    tokenizer, byte_level = script.load_tokenizer(data)
    _, heldout, test, length = script.load_datasets(data, tokenizer, byte_level)
    if args.split == "test" and test is None:
        raise ValueError(f"--corpus {data.corpus} has no test split here; use --split validation (held-out data).")
    dataset = test if args.split == "test" else heldout
    loader = eval_loader(dataset, args.per_device_eval_batch_size, accelerator)
    bpd = evaluate_bits_per_dim(model, loader, accelerator, args.max_eval_batches)
    return {"bits_per_dim": bpd, "corpus": data.corpus, "sequences": len(dataset), "sequence_length": length}


def evaluate_translation(script, args, data, model, accelerator) -> dict:
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq

    from attnzoo.training.translation_data import load_parallel_corpus, references, tokenize_pairs

    raw = load_parallel_corpus(data)
    split = args.split if args.split in raw else "validation"
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenized = tokenize_pairs({split: raw[split]}, tokenizer, data)
    generation = accelerator.unwrap_model(model, keep_torch_compile=False).generation_config
    if args.num_beams is not None:
        generation.num_beams = args.num_beams
    if args.length_penalty is not None:
        generation.length_penalty = args.length_penalty
    loader = eval_loader(tokenized[split], args.per_device_eval_batch_size, accelerator,
                         DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100))
    bleu, hypotheses = script.evaluate_bleu(model, loader, tokenizer, accelerator,
                                            references(raw[split], data.target_lang), args.max_eval_batches)
    return {"bleu": bleu["sacrebleu"]["score"], "bleu_signature": bleu["sacrebleu"]["signature"],
            "all_bleu": bleu, "split": split, "num_sentences": len(hypotheses),
            "num_beams": generation.num_beams, "length_penalty": generation.length_penalty}


def evaluate_image_classification(script, args, data, model, accelerator) -> dict:
    from attnzoo.training.classification_data import collate_images, load_labelled_images, with_transform

    raw, names = load_labelled_images(data)
    split = args.split if args.split in raw else "validation"
    _, transform = script.build_transforms(data)
    dataset = with_transform(raw[split], transform, data.image_column, data.label_column)
    loader = eval_loader(dataset, args.per_device_eval_batch_size, accelerator, collate_images)
    accuracy = evaluate_top1(model, loader, accelerator, args.max_eval_batches)
    return {"top1_accuracy": accuracy, "split": split, "num_images": len(dataset), "num_labels": len(names)}


def main(argv=None) -> dict:
    args, rest = build_parser().parse_known_args(argv)
    if args.per_device_eval_batch_size < 1:
        raise ValueError(f"--per_device_eval_batch_size={args.per_device_eval_batch_size} must be positive.")
    with reading_model_source(args.model_name_or_path):
        config = AutoConfig.from_pretrained(args.model_name_or_path)
    task = detect_task(config) if args.task == "auto" else args.task
    script = load_script(TASK_SCRIPTS[task])
    data = data_arguments(script, args.model_name_or_path, rest)
    accelerator = Accelerator(cpu=not torch.accelerator.is_available(), mixed_precision=args.mixed_precision)

    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSeq2SeqLM

    auto = {"lm": AutoModelForCausalLM, "translation": AutoModelForSeq2SeqLM,
            "image_classification": AutoModelForImageClassification}[task]
    model = accelerator.prepare(auto.from_pretrained(args.model_name_or_path).eval())
    evaluate = {"lm": evaluate_lm, "translation": evaluate_translation,
                "image_classification": evaluate_image_classification}[task]
    results = {"model": args.model_name_or_path, "task": task, "split": args.split,
               **evaluate(script, args, data, model, accelerator)}
    if accelerator.is_main_process:
        shown = {k: v for k, v in results.items() if k != "all_bleu"}
        print(json.dumps(shown, indent=2))
        if args.output_file:
            Path(args.output_file).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
