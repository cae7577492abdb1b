"""Fine-tune an attnzoo checkpoint for text classification on your own CSV or JSON-lines file, with transformers'
Trainer: every `TrainingArguments` flag works (gradient accumulation, bf16, evaluation strategy, --push_to_hub, ...).

    python scripts/finetune_text_classification.py --model_name_or_path runs/quickstart \\
        --train_file train.csv --validation_file dev.csv --text_column text --label_column label \\
        --output_dir runs/classifier --num_train_epochs 3 --learning_rate 5e-4

The file needs a text column and a label column (strings or integers). Any attnzoo checkpoint works as the start: a
causal LM (`train_lm.py`'s output; the classifier then reads the last real token, as GPT-2 classifiers do), a masked
LM or a classifier; a new classification head is added. The output folder loads with
`AutoModelForSequenceClassification` and `pipeline("text-classification", model=...)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from accelerate import PartialState
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import attnzoo  # noqa: F401  (registers the attnzoo_* model types)
from attnzoo.training.data_checks import missing_file_reason
from attnzoo.training.run_dir import check_output_dir, record_outputs, start_output_dir


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "an attnzoo checkpoint folder or Hub id"})
    train_file: str = field(metadata={"help": "a .csv or .json/.jsonl file"})
    validation_file: str | None = field(default=None, metadata={"help": "default: hold out --validation_split"})
    validation_split: float = field(default=0.1, metadata={"help": "share of the training file held out"})
    text_column: str = "text"
    label_column: str = "label"
    max_length: int | None = field(default=None, metadata={"help": "truncate longer texts (default: the model's "
                                                                   "max_position_embeddings)"})
    pooling: str | None = field(default=None, metadata={"help": "mean, last or cls (default: last for a causal "
                                                                "checkpoint, else the checkpoint's)"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "start over in --output_dir: delete the files an earlier run of this script wrote there (a folder "
                "holding anything else is refused, never emptied)"})


SCRIPT = "finetune_text_classification"


def run_folder_arguments(args: ScriptArguments, training_args: TrainingArguments) -> argparse.Namespace:
    """What the shared output-folder rule (attnzoo.training.run_dir) reads: the folder, resume or overwrite, and the
    settings a resumed run must keep."""
    resume = training_args.resume_from_checkpoint
    if resume is not None and resume.lower() == "true":  # the Trainer's own spelling of "the newest checkpoint"
        resume = "latest"
    return argparse.Namespace(output_dir=training_args.output_dir, overwrite_output_dir=args.overwrite_output_dir,
                              resume_from_checkpoint=resume,
                              model_name_or_path=args.model_name_or_path, train_file=args.train_file,
                              seed=training_args.seed)


def trainer_resume_point(resume_from_checkpoint: str | None):
    """Trainer's `resume_from_checkpoint`: "latest" is its True, the newest checkpoint-N of the run."""
    return True if resume_from_checkpoint == "latest" else resume_from_checkpoint


class RecordOutputs(TrainerCallback):
    """Adds each checkpoint-N the Trainer writes to the run record, so --overwrite_output_dir can delete it."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            record_outputs(args.output_dir)


def load_table(args: ScriptArguments):
    """The train/validation DatasetDict, labels encoded as integers, and the label names."""
    from datasets import ClassLabel, load_dataset

    files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
    for path in files.values():
        if not Path(path).is_file():
            state = missing_file_reason(path)
            raise ValueError(f"{path} {state}; pass a .csv or .json/.jsonl file.")
    suffixes = {Path(p).suffix.lower() for p in files.values()}
    if len(suffixes) != 1 or next(iter(suffixes)) not in (".csv", ".json", ".jsonl"):
        raise ValueError(f"use .csv or .json/.jsonl files (one kind for both), not {sorted(suffixes)}.")
    raw = load_dataset("csv" if ".csv" in suffixes else "json", data_files=files)
    for column in (args.text_column, args.label_column):
        if column not in raw["train"].column_names:
            raise ValueError(f"{args.train_file} has no column {column!r}; its columns are "
                             f"{raw['train'].column_names}. Pass --text_column / --label_column.")
    for split, rows in raw.items():  # a blank label would otherwise become a class named "None"
        blank = [i for i, value in enumerate(rows[args.label_column]) if value is None or str(value).strip() == ""]
        if blank:
            raise ValueError(f"{files[split]}: {len(blank)} row(s) have no {args.label_column!r} (first: data row "
                             f"{blank[0] + 1}); give every row a label, or remove the unlabelled rows.")
    if not isinstance(raw["train"].features[args.label_column], ClassLabel):  # strings or integers in the file
        labels = ClassLabel(names=sorted({str(v) for split in raw.values() for v in split[args.label_column]}))
        raw = raw.map(lambda row: {args.label_column: labels.str2int(str(row[args.label_column]))})
        raw = raw.cast_column(args.label_column, labels)
    if "validation" not in raw:
        parts = raw["train"].train_test_split(test_size=args.validation_split, seed=0)
        raw["train"], raw["validation"] = parts["train"], parts["test"]
    names = list(raw["train"].features[args.label_column].names)
    if len(names) < 2:
        raise ValueError(f"{args.label_column!r} holds {len(names)} class(es); classification needs at least 2.")
    return raw, names


def build_model(args: ScriptArguments, names: list[str]):
    config = AutoConfig.from_pretrained(args.model_name_or_path)
    pooling = args.pooling or ("last" if config.is_decoder else config.pooling)
    return AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)}, pooling=pooling, ignore_mismatched_sizes=True)


def accuracy(prediction) -> dict:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def main(argv=None):
    args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    folder_args = run_folder_arguments(args, training_args)
    check_output_dir(folder_args, SCRIPT)  # before anything is loaded or written
    raw, names = load_table(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {args.model_name_or_path} has no pad (or eos) token to batch texts "
                             "with; save one with tokenizer.add_special_tokens({'pad_token': ...}).")
        tokenizer.pad_token = tokenizer.eos_token
    model = build_model(args, names)
    max_length = args.max_length or model.config.max_position_embeddings
    encoded = raw.map(lambda rows: tokenizer(rows[args.text_column], truncation=True, max_length=max_length),
                      batched=True, remove_columns=[c for c in raw["train"].column_names if c != args.label_column])
    encoded = encoded.rename_column(args.label_column, "labels")
    trainer = Trainer(model=model, args=training_args, train_dataset=encoded["train"],
                      eval_dataset=encoded["validation"], processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy,
                      callbacks=[RecordOutputs()])
    start_output_dir(PartialState(), folder_args, SCRIPT, model.config.model_type, args.model_name_or_path)
    trainer.train(resume_from_checkpoint=trainer_resume_point(folder_args.resume_from_checkpoint))
    metrics = trainer.evaluate()
    trainer.save_model()
    trainer.save_metrics("eval", metrics)
    if trainer.is_world_process_zero():
        record_outputs(training_args.output_dir)
    if trainer.is_world_process_zero():
        print(json.dumps(metrics))
    if training_args.push_to_hub:
        trainer.push_to_hub(finetuned_from=args.model_name_or_path, tasks="text-classification")
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
