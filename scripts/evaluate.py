"""Evaluate any saved or Hub checkpoint of the zoo: bits/dim (text and images), BLEU, top-1 accuracy, or any
lm-evaluation-harness task (causal LMs; the optional extra: pip install 'attnzoo[lm-eval]').

    python scripts/evaluate.py --model_name_or_path runs/quickstart
    python scripts/evaluate.py --model_name_or_path runs/enwik8 --split test --data_dir data/enwik8
    accelerate launch scripts/evaluate.py --model_name_or_path user/attnzoo-wmt14 --num_beams 4
    python scripts/evaluate.py --model_name_or_path runs/deit --validation_dir data/imagenet/val
    python scripts/evaluate.py --model_name_or_path runs/quickstart --lm_eval_tasks attnzoo_pydoc
    python scripts/evaluate.py --model_name_or_path runs/gpt2-performer --lm_eval_tasks hellaswag,my_task \\
        --include_path my_tasks/ --num_fewshot 0

The task follows from the checkpoint (encoder-decoder: translation; image classifier: top-1; otherwise causal LM:
bits/dim). Data arguments are those of the training script and default to the values the run was trained with
(training_args.json beside the weights), so a run folder evaluates with no other argument; any data argument of the
training script can be given to change them.

--lm_eval_tasks runs lm-eval's `hf` model on the checkpoint instead, with tasks by name (lm-eval's own, attnzoo's
attnzoo_pydoc_* tasks from attnzoo/evaluation/tasks, or those of --include_path folders), and writes the results into
the model card (README.md of a local model folder, or --model_card FILE) beside the bits/dim or BLEU of training.
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
#: the lm-eval options and their defaults: given without --lm_eval_tasks they would do nothing, so that is an error
LM_EVAL_OPTIONS = {"include_path": [], "num_fewshot": None, "lm_eval_limit": None, "lm_eval_model_args": "",
                   "lm_eval_metadata": None, "trust_remote_code": False, "model_card": "auto"}
#: the files a saved tokenizer is read from: transformers' AutoTokenizer knows no tokenizer class for attnzoo's model
#: types, so a model folder without one of these holds no tokenizer it can load
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
    parser.add_argument("--output_file", default=None,
                        help="also write the results as JSON here (a new file, or one this script wrote before)")
    harness = parser.add_argument_group("lm-evaluation-harness (pip install 'attnzoo[lm-eval]')")
    harness.add_argument("--lm_eval_tasks", default=None,
                         help="comma-separated lm-eval tasks, groups, tags or YAML files (e.g. attnzoo_pydoc); runs "
                              "lm-eval instead of the built-in metric (per_device_eval_batch_size is its batch size)")
    harness.add_argument("--include_path", action="append", default=[],
                         help="a folder of lm-eval task YAML files (repeatable); attnzoo's own tasks are always found")
    harness.add_argument("--num_fewshot", type=int, default=None, help="default: each task's own (0 if unset)")
    harness.add_argument("--lm_eval_limit", type=float, default=None,
                         help="score only this many documents per task (below 1: this fraction); for quick checks")
    harness.add_argument("--lm_eval_model_args", default="",
                         help="more arguments of lm-eval's hf model, as its --model_args (e.g. dtype=bfloat16)")
    harness.add_argument("--lm_eval_metadata", default=None,
                         help="a JSON object for the tasks, as lm-eval's --metadata (e.g. the pass-key tasks' "
                              "'{\"max_seq_lengths\": [1024, 4096]}')")
    harness.add_argument("--trust_remote_code", action="store_true",
                         help="let lm-eval run the checkpoint's own code (not needed for attnzoo's families here)")
    harness.add_argument("--model_card", default="auto",
                         help="where lm-eval results go: 'auto' (README.md of a local model folder), a file, or "
                              "'none'")
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


def holds_tokenizer(name_or_path) -> bool:
    """Whether a local folder holds a saved tokenizer; a Hub id (no such folder here) is left to transformers."""
    folder = Path(name_or_path)
    return not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_source(args, data, task: str) -> str | None:
    """Where the tokenizer of a bits/dim or BLEU evaluation comes from (None: the task reads no text): the training
    script's --tokenizer_name (given, or recorded by the run) for a language model, as train_lm.py loads it; the
    model folder's own for translation, or --tokenizer_name where the folder has none. A folder without a tokenizer
    is refused before the model is loaded, naming it and what it lacks (transformers would only say that
    sentencepiece or tiktoken is not installed)."""
    if task == "lm" and data.corpus != "imagenet64":
        name = data.tokenizer_name or args.model_name_or_path
    elif task == "translation":
        own = holds_tokenizer(args.model_name_or_path) or not data.tokenizer_name
        name = args.model_name_or_path if own else data.tokenizer_name
    else:
        return None
    if holds_tokenizer(name):
        return name
    where = f"the model folder {name}" if name == args.model_name_or_path else f"--tokenizer_name {name}"
    metric = {"lm": "bits/dim", "translation": "BLEU"}[task]
    raise ValueError(f"{where} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}), and the {metric} "
                     "evaluation reads text through one: pass --tokenizer_name NAME_OR_FOLDER naming a saved tokenizer "
                     "(the one the model was trained with), or save that tokenizer into the model folder "
                     "(tokenizer.save_pretrained).")


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
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(args, data, "translation"))
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


def model_card_path(args) -> Path | None:
    """The card lm-eval results are written into: --model_card, or README.md of a local model folder (a Hub id has
    none here: pass --model_card FILE)."""
    if args.model_card == "none":
        return None
    if args.model_card != "auto":
        return Path(args.model_card)
    folder = Path(args.model_name_or_path)
    return folder / "README.md" if folder.is_dir() else None


def lm_eval_metadata(text: str | None) -> dict | None:
    """--lm_eval_metadata as a dict; a ValueError naming the flag for anything but a JSON object."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--lm_eval_metadata {text!r} is not JSON ({error.msg}); pass an object, e.g. "
                         "'{\"max_seq_lengths\": [1024]}'.") from None
    if not isinstance(value, dict):
        raise ValueError(f"--lm_eval_metadata {text!r} is a JSON {type(value).__name__}; pass an object, e.g. "
                         "'{\"max_seq_lengths\": [1024]}'.")
    return value


def evaluate_lm_eval(args, task: str, rest: list[str]) -> dict | None:
    """lm-eval's `hf` model on the checkpoint: the results as rows, also written into the model card (None on the
    processes other than the main one)."""
    from attnzoo.evaluation import harness

    version = harness.lm_eval_version()
    from lm_eval.utils import simple_parse_args_string

    if task != "lm":
        raise ValueError(f"--lm_eval_tasks evaluates causal language models; {args.model_name_or_path} is a {task} "
                         "model. Evaluate it without --lm_eval_tasks.")
    if rest:
        raise ValueError(f"{rest}: data arguments have no effect with --lm_eval_tasks (the tasks bring their data); "
                         "drop them.")
    tasks = [name.strip() for name in args.lm_eval_tasks.split(",") if name.strip()]
    model_args = simple_parse_args_string(args.lm_eval_model_args)
    folder = Path(args.model_name_or_path)
    if not holds_tokenizer(folder) and "tokenizer" not in model_args:
        raise ValueError(f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}; a pixel LM has none), "
                         "and lm-eval's tasks are text; pass one with --lm_eval_model_args tokenizer=NAME_OR_FOLDER, "
                         "or save the model's tokenizer into the folder (tokenizer.save_pretrained(folder)).")
    if args.trust_remote_code:
        model_args["trust_remote_code"] = True
    if args.mixed_precision != "no":
        model_args.setdefault("mixed_precision_dtype", {"bf16": "bfloat16", "fp16": "float16"}[args.mixed_precision])
    device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    limit = args.lm_eval_limit
    if limit is not None and limit >= 1:
        limit = int(limit)  # lm-eval reads a float as a fraction of the task
    raw = harness.run(args.model_name_or_path, tasks, include_path=args.include_path,
                      batch_size=args.per_device_eval_batch_size, num_fewshot=args.num_fewshot, limit=limit,
                      device=device, model_args=model_args, metadata=lm_eval_metadata(args.lm_eval_metadata))
    if raw is None:  # not the main process of a multi-process run: lm-eval reports on the main one
        return None
    rows = harness.summarize(raw)
    card = model_card_path(args)
    if card is not None:
        from attnzoo.training.model_card import add_eval_results, lm_eval_results

        add_eval_results(card, lm_eval_results(rows, version), model_name=Path(args.model_name_or_path).name)
    return {"lm_eval": rows, "lm_eval_version": version, "model_card": str(card) if card else None,
            "lm_eval_raw": {k: raw[k] for k in ("results", "n-shot", "n-samples", "versions", "config") if k in raw}}


RESULTS_MARK = "evaluate"  # the "script" entry of the results files this script writes


def check_output_file(path: str | None) -> None:
    """--output_file may name a new file or one this script wrote before (a JSON object marked with
    "script": "evaluate"), which is replaced; anything else is refused before the model is loaded."""
    if path is None or not Path(path).exists():
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--output_file {target} is a folder; name a file for the results (e.g. "
                         f"{target / 'eval_results.json'}).")
    try:
        earlier = json.loads(target.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        earlier = None
    if not (isinstance(earlier, dict) and earlier.get("script") == RESULTS_MARK):
        raise ValueError(f"--output_file {target} already exists and is not a results file of this script; it is "
                         "left as it is. Name another file (or move that one away).")


def main(argv=None) -> dict:
    args, rest = build_parser().parse_known_args(argv)
    check_output_file(args.output_file)
    if args.per_device_eval_batch_size < 1:
        raise ValueError(f"--per_device_eval_batch_size={args.per_device_eval_batch_size} must be positive.")
    # lm-eval only asserts this deep inside a run (a bare AssertionError), and only where it is installed.
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num_fewshot={args.num_fewshot} is invalid: set the number of examples shown before each "
                         "question (0: none), or leave it out for each task's own.")
    if args.lm_eval_tasks is not None:
        from attnzoo.evaluation.harness import lm_eval_version

        lm_eval_version()  # without the extra, say how to install it before loading anything
    else:
        given = [f"--{name}" for name, default in LM_EVAL_OPTIONS.items() if getattr(args, name) != default]
        if given:
            raise ValueError(f"{given} apply to lm-eval runs only: add --lm_eval_tasks TASKS, or drop them.")
    with reading_model_source(args.model_name_or_path):
        config = AutoConfig.from_pretrained(args.model_name_or_path)
    task = detect_task(config) if args.task == "auto" else args.task
    if args.lm_eval_tasks is not None:
        found = evaluate_lm_eval(args, task, rest)
        return report({"model": args.model_name_or_path, "task": "lm_eval", **(found or {})}, args,
                      main_process=found is not None)
    script = load_script(TASK_SCRIPTS[task])
    data = data_arguments(script, args.model_name_or_path, rest)
    tokenizer_source(args, data, task)  # a missing tokenizer is named before the model and the data are loaded
    accelerator = Accelerator(cpu=not torch.accelerator.is_available(), mixed_precision=args.mixed_precision)

    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSeq2SeqLM

    auto = {"lm": AutoModelForCausalLM, "translation": AutoModelForSeq2SeqLM,
            "image_classification": AutoModelForImageClassification}[task]
    model = accelerator.prepare(auto.from_pretrained(args.model_name_or_path).eval())
    evaluate = {"lm": evaluate_lm, "translation": evaluate_translation,
                "image_classification": evaluate_image_classification}[task]
    results = {"model": args.model_name_or_path, "task": task, "split": args.split,
               **evaluate(script, args, data, model, accelerator)}
    return report(results, args, accelerator.is_main_process)


def report(results: dict, args, main_process: bool) -> dict:
    """Print the results (without the long ones) and write them all to --output_file, on the main process."""
    if main_process:
        shown = {k: v for k, v in results.items() if k not in ("all_bleu", "lm_eval_raw")}
        print(json.dumps(shown, indent=2))
        if args.output_file:
            path = Path(args.output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"script": RESULTS_MARK, **results}, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
