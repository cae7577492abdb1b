"""Train an encoder-decoder translation model with any attnzoo family (WMT14 en→de by default) and report BLEU.

    accelerate launch scripts/train_translation.py --recipe recipes/lara16_wmt14.yaml
    python scripts/prepare_gettext_corpus.py --output_dir data/gettext-en-de    # a small offline en-de corpus
    accelerate launch scripts/train_translation.py --recipe recipes/quickstart_translation.yaml

Data: `datasets`' wmt/wmt14 (config de-en) or local JSON lines with the same {"translation": {"de", "en"}} rows.
A shared byte-level BPE is trained on the training pairs (or loaded with --tokenizer_name). The encoder uses the
config's `attn_layers`, the decoder `decoder_attn_layers` (arXiv 2204.04667 §5.4 replaces only the encoder's attention).
Evaluation decodes with beam 4 and length penalty 0.6, optionally after averaging the last K checkpoints
(arXiv 2204.04667 appendix H.4), and reports sacreBLEU (with its signature) and a tokenised BLEU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object, set_seed
from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq

from attnzoo.modeling.heads import shift_tokens_right
from attnzoo.training.arguments import add_model_arguments, add_training_arguments, check_training_arguments
from attnzoo.training.checkpoints import (
    average_checkpoint_weights,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from attnzoo.training.loop import (
    RunningMean,
    build_accelerator,
    eval_loader,
    log_and_checkpoint,
    new_model_config,
    prepare_run,
    progress_bar,
    save_final_model,
    to_device,
    train_batches,
    train_loader,
    training_record,
    training_step,
)
from attnzoo.training.metrics import bleu_scores
from attnzoo.training.model_card import bleu_results, build_model_card
from attnzoo.training.publish import publish_run
from attnzoo.training.recipes import parse_with_recipe
from attnzoo.training.translation_data import (
    load_or_train_tokenizer,
    load_parallel_corpus,
    references,
    tokenize_pairs,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", default=None, help="e.g. wmt/wmt14")
    data.add_argument("--dataset_config_name", default=None, help="e.g. de-en")
    data.add_argument("--train_file", default=None, help="JSON lines of {'translation': {src: ..., tgt: ...}}")
    data.add_argument("--validation_file", default=None)
    data.add_argument("--test_file", default=None)
    data.add_argument("--source_lang", default="en")
    data.add_argument("--target_lang", default="de")
    data.add_argument("--max_source_length", type=int, default=256)
    data.add_argument("--max_target_length", type=int, default=256)
    data.add_argument("--max_train_samples", type=int, default=0, help="use the first N training pairs (0: all)")
    data.add_argument("--max_eval_samples", type=int, default=0, help="evaluate on the first N pairs (0: all)")
    data.add_argument("--tokenizer_name", default=None, help="a saved tokenizer instead of training a BPE")
    data.add_argument("--bpe_vocab_size", type=int, default=32000)
    data.add_argument("--bpe_min_frequency", type=int, default=2)
    decode = parser.add_argument_group("decoding and scoring")
    decode.add_argument("--num_beams", type=int, default=4)
    decode.add_argument("--length_penalty", type=float, default=0.6)
    decode.add_argument("--generation_max_length", type=int, default=0,
                        help="most new tokens per translation (0: --max_target_length)")
    decode.add_argument("--label_smoothing", type=float, default=0.1)
    decode.add_argument("--average_last_checkpoints", type=int, default=1,
                        help="evaluate and save the mean weights of the last K checkpoints (arXiv 2204.04667: 10)")
    decode.add_argument("--eval_split", default="test", help="split of the final BLEU (falls back to validation)")
    add_training_arguments(parser, learning_rate=7e-4, adam_beta2=0.98, weight_decay=0.0,
                           lr_scheduler_type="inverse_sqrt", num_warmup_steps=4000, max_grad_norm=0.0,
                           per_device_train_batch_size=32, per_device_eval_batch_size=32,
                           output_dir="runs/translation")
    return parser


def check_arguments(args) -> None:
    check_training_arguments(args)
    if args.num_beams < 1:
        raise ValueError(f"--num_beams={args.num_beams} is invalid: set 1 (greedy) or more.")
    if not 0.0 <= args.label_smoothing < 1.0:
        raise ValueError(f"--label_smoothing={args.label_smoothing} is invalid: set a value in [0, 1).")
    if args.average_last_checkpoints < 1:
        raise ValueError(f"--average_last_checkpoints={args.average_last_checkpoints} is invalid: set 1 (no "
                         "averaging) or more.")
    if args.average_last_checkpoints > 1:
        if not args.checkpointing_steps:
            raise ValueError("--average_last_checkpoints needs checkpoints: set --checkpointing_steps.")
        if 0 < args.checkpoints_total_limit < args.average_last_checkpoints:
            raise ValueError(f"--checkpoints_total_limit={args.checkpoints_total_limit} keeps fewer checkpoints than "
                             f"--average_last_checkpoints={args.average_last_checkpoints}; raise the limit.")
    if args.source_lang == args.target_lang:
        raise ValueError("--source_lang and --target_lang are the same; pick two languages of the corpus.")
    if args.bpe_vocab_size < 300:
        raise ValueError(f"--bpe_vocab_size={args.bpe_vocab_size} is too small: the byte alphabet alone takes 256 "
                         "tokens plus 4 special ones.")


def build_model(args, tokenizer):
    if args.model_name_or_path:
        return AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)
    values = dict(vocab_size=len(tokenizer), is_encoder_decoder=True, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  decoder_start_token_id=tokenizer.bos_token_id,
                  max_position_embeddings=max(args.max_source_length, args.max_target_length))
    return AutoModelForSeq2SeqLM.from_config(new_model_config(args.family, values, args.model))


def set_decoding_defaults(model, args, tokenizer) -> None:
    """Saved in generation_config.json, so `generate()` after `from_pretrained` decodes the way BLEU was measured."""
    generation = model.generation_config
    generation.num_beams = args.num_beams
    generation.length_penalty = args.length_penalty
    generation.max_new_tokens = args.generation_max_length or args.max_target_length
    generation.early_stopping = True
    generation.pad_token_id = tokenizer.pad_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    generation.decoder_start_token_id = model.config.decoder_start_token_id


def smoothed_loss(model, batch, label_smoothing: float, pad_id: int, start_id: int) -> torch.Tensor:
    """Label-smoothed cross-entropy over the target tokens (mean over non-padding tokens of this process)."""
    decoder_input_ids = shift_tokens_right(batch["labels"], pad_id, start_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=decoder_input_ids, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                           label_smoothing=label_smoothing)


@torch.no_grad()
def translate(model, loader, tokenizer, accelerator, max_batches: int = 0) -> list[str]:
    """Beam-search translations of every example of the (sharded) loader, gathered in dataset order."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    was_training = unwrapped.training
    unwrapped.eval()
    mine = []
    rank, world = accelerator.process_index, accelerator.num_processes
    position = 0
    for index, batch in enumerate(loader):
        if max_batches and index >= max_batches:
            break
        batch = to_device(batch, accelerator)
        out = unwrapped.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 generation_config=unwrapped.generation_config)
        for text in tokenizer.batch_decode(out, skip_special_tokens=True):
            mine.append((rank + world * position, text.strip()))  # eval_loader gives example rank + world * i
            position += 1
    unwrapped.train(was_training)
    return [text for _, text in sorted(gather_object(mine))]


def evaluate_bleu(model, loader, tokenizer, accelerator, refs: list[str], max_batches: int = 0) -> dict:
    hypotheses = translate(model, loader, tokenizer, accelerator, max_batches)
    return bleu_scores(hypotheses, refs[: len(hypotheses)]), hypotheses


def main(argv=None):
    args = parse_with_recipe(build_parser(), argv)
    check_arguments(args)
    accelerator = build_accelerator(args, "train_translation")
    set_seed(args.seed)
    raw, tokenizer, tokenized, model = build_data_and_model(args, accelerator)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100,
                                      pad_to_multiple_of=8 if args.mixed_precision != "no" else None)
    validation = eval_loader(tokenized["validation"], args.per_device_eval_batch_size, accelerator, collator)
    run = prepare_run(accelerator, args, model, train_loader(tokenized["train"], args.per_device_train_batch_size,
                                                             args.seed, collate_fn=collator), "train_translation")
    accelerator.print(f"{run.num_parameters / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
                      f"{len(tokenized['train'])} training pairs, {run.max_steps} steps, "
                      f"{accelerator.num_processes} process(es)")
    step = train(accelerator, args, run, tokenizer, validation, references(raw["validation"], args.target_lang))
    results, hypotheses = final_evaluation(accelerator, args, run, raw, tokenized, tokenizer, collator, step)
    results["train_seconds"] = run.guard.training_seconds()
    save_and_publish(accelerator, args, run.model, tokenizer, results, hypotheses)
    accelerator.end_training()
    return results


def build_data_and_model(args, accelerator):
    """The parallel corpus, its tokenizer (trained here unless given), the tokenised pairs and the model."""
    with accelerator.main_process_first():
        raw = load_parallel_corpus(args)
    tokenizer = load_or_train_tokenizer(args, raw, accelerator)
    with accelerator.main_process_first():
        tokenized = tokenize_pairs(raw, tokenizer, args)
    model = build_model(args, tokenizer)
    set_decoding_defaults(model, args, tokenizer)
    return raw, tokenizer, tokenized, model


def train(accelerator, args, run, tokenizer, validation_loader, validation_refs) -> int:
    """The training loop from the run's start step (label-smoothed loss, BLEU every --eval_steps); the last step."""
    model, step = run.model, run.start_step
    pad_id, start_id = model.config.pad_token_id, model.config.decoder_start_token_id
    progress = progress_bar(accelerator, run.max_steps, step)
    train_loss = RunningMean()
    started = run.guard.start_clock()
    model.train()
    for batch in run.guard.watch(train_batches(accelerator, run.loader, step)) if step < run.max_steps else ():
        loss = training_step(accelerator, model, run.optimizer, run.scheduler, args.max_grad_norm,
                             lambda b=batch: smoothed_loss(model, b, args.label_smoothing, pad_id, start_id),
                             run.guard)
        train_loss.add(loss)
        if not accelerator.sync_gradients:
            continue
        step += 1
        progress.update(1)
        record = training_record(accelerator, args, step, run.max_steps, train_loss, run.scheduler, started, progress)
        if args.eval_steps and step % args.eval_steps == 0:
            bleu, _ = evaluate_bleu(model, validation_loader, tokenizer, accelerator, validation_refs,
                                    args.max_eval_batches)
            record["eval_bleu"] = bleu["sacrebleu"]["score"]
        log_and_checkpoint(accelerator, args, Path(args.output_dir), step, record, run.guard)
        if step >= run.max_steps:
            break
    progress.close()
    return step


def final_evaluation(accelerator, args, run, raw, tokenized, tokenizer, collator, step: int):
    """Checkpoint averaging, then BLEU on --eval_split: (results, the hypotheses)."""
    averaged = average_last_checkpoints(accelerator, run.model, args, Path(args.output_dir), step)
    eval_split = args.eval_split if args.eval_split in raw else "validation"
    final_loader = eval_loader(tokenized[eval_split], args.per_device_eval_batch_size, accelerator, collator)
    bleu, hypotheses = evaluate_bleu(run.model, final_loader, tokenizer, accelerator,
                                     references(raw[eval_split], args.target_lang), args.max_eval_batches)
    results = {"eval_bleu": bleu["sacrebleu"]["score"], "bleu": bleu, "eval_split": eval_split,
               "num_sentences": len(hypotheses), "train_steps": step, "averaged_checkpoints": averaged,
               "num_parameters": run.num_parameters, "vocab_size": len(tokenizer),
               "num_processes": accelerator.num_processes}
    accelerator.log({"eval_bleu": results["eval_bleu"]}, step=step)
    return results, hypotheses


def save_and_publish(accelerator, args, model, tokenizer, results: dict, hypotheses: list[str]) -> None:
    output_dir = Path(args.output_dir)
    unwrapped = save_final_model(accelerator, model, output_dir, tokenizer=tokenizer)
    results["family"] = unwrapped.config.model_type.removeprefix("attnzoo_")
    eval_split, bleu = results["eval_split"], results["bleu"]
    if accelerator.is_main_process:
        (output_dir / f"{eval_split}_translations.txt").write_text("\n".join(hypotheses) + "\n")
    accelerator.print(f"{eval_split} sacreBLEU {bleu['sacrebleu']['score']:.2f} ({bleu['sacrebleu']['signature']}), "
                      f"tokenised BLEU {bleu['tokenized_bleu']['score']:.2f}; model saved to {output_dir}")
    publish_run(accelerator, args, results, lambda: translation_card(args, unwrapped, results), title=str(output_dir))


def average_last_checkpoints(accelerator, model, args, output_dir: Path, step: int) -> int:
    """Replace the weights by the mean of the last K checkpoints (the final state included); returns K used."""
    k = args.average_last_checkpoints
    if k <= 1:
        return 1
    if not any(s == step and not verify_checkpoint(f) for s, f in list_checkpoints(output_dir)):
        save_checkpoint(accelerator, output_dir, step, args.checkpoints_total_limit)
    folders = [folder for _, folder in list_checkpoints(output_dir) if not verify_checkpoint(folder)][-k:]
    averaged = average_checkpoint_weights(folders)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    missing, unexpected = unwrapped.load_state_dict(averaged, strict=False)
    tied = set(getattr(unwrapped, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise ValueError(f"averaged checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    accelerator.print(f"averaged the weights of {len(folders)} checkpoints: {[f.name for f in folders]}")
    return len(folders)


def translation_card(args, model, results: dict):
    dataset_name = args.dataset_name or Path(args.train_file).parent.name
    config_name = args.dataset_config_name or f"{args.target_lang}-{args.source_lang}"
    return build_model_card(
        "translation", args=args, config=model.config, num_parameters=results["num_parameters"], results=results,
        eval_results=bleu_results(results["bleu"], dataset_name, args.dataset_name or "json",
                                  results["eval_split"], config_name),
        pipeline_tag="translation", datasets=[args.dataset_name] if args.dataset_name else None,
        language=[args.source_lang, args.target_lang], dataset_name=dataset_name, source_lang=args.source_lang,
        target_lang=args.target_lang, vocab_size=results["vocab_size"], averaged=results["averaged_checkpoints"],
        num_beams=args.num_beams, length_penalty=args.length_penalty, eval_split=results["eval_split"],
        num_sentences=results["num_sentences"], bleu=results["bleu"])


if __name__ == "__main__":
    main()
