"""Parallel text for translation: WMT14 from `datasets` (`wmt/wmt14`, config `de-en`) or local JSON lines with the
same schema ({"translation": {"de": ..., "en": ...}}), a shared byte-level BPE trained with `tokenizers` (about 32K
merges-based tokens for WMT14, arXiv 2204.04667 §5.4), and the tokenised examples a seq2seq collator pads."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from attnzoo.training.data_checks import checked_json_files

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"  # ids 0, 1, 2, 3 in a trained tokenizer


def load_parallel_corpus(args):
    """A DatasetDict with 'train' and 'validation' (and 'test' when given) whose rows hold `translation` dicts."""
    from datasets import load_dataset

    if args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
    else:
        files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
        files = {split: path for split, path in files.items() if path}
        if "train" not in files or "validation" not in files:
            raise ValueError("pass --dataset_name (e.g. wmt/wmt14 with --dataset_config_name de-en) or local JSON "
                             "lines files --train_file and --validation_file (and optionally --test_file).")
        missing = [p for p in files.values() if not Path(p).is_file()]
        if missing:
            raise ValueError(f"{missing} not found; pass existing JSON lines files.")
        src, tgt = args.source_lang, args.target_lang
        with checked_json_files(files, lambda row: translation_row_problem(row, src, tgt),
                                getattr(args, "skip_bad_examples", False), "translation pair") as checked:
            raw = load_dataset("json", data_files=checked)
    for split in ("train", "validation"):
        if split not in raw:
            raise ValueError(f"the corpus has splits {list(raw)}; it needs 'train' and 'validation'.")
    first = raw["train"][0]
    pair = first.get("translation") if isinstance(first, dict) else None
    if not isinstance(pair, dict) or args.source_lang not in pair or args.target_lang not in pair:
        raise ValueError(f"rows must look like {{'translation': {{'{args.source_lang}': ..., '{args.target_lang}': "
                         f"...}}}}; the first row is {str(first)[:200]}. Check --source_lang/--target_lang.")
    if args.max_train_samples:
        raw["train"] = raw["train"].select(range(min(args.max_train_samples, len(raw["train"]))))
    for split in ("validation", "test"):
        if args.max_eval_samples and split in raw:
            raw[split] = raw[split].select(range(min(args.max_eval_samples, len(raw[split]))))
    return raw


def translation_row_problem(row: dict, source_lang: str, target_lang: str) -> str | None:
    """What keeps a JSON row from being a {"translation": {source: text, target: text}} pair (None: nothing)."""
    pair = row.get("translation")
    if not isinstance(pair, dict):
        return f"no 'translation' object (the row's fields: {sorted(row)})"
    for lang in (source_lang, target_lang):
        if lang not in pair:
            return (f"'translation' has no '{lang}' text (it has {sorted(pair)}; check --source_lang/"
                    "--target_lang)")
        if not isinstance(pair[lang], str):
            return f"'translation'.'{lang}' is a {type(pair[lang]).__name__}, not text"
    return None


def train_shared_bpe(pairs, languages: tuple[str, str], vocab_size: int, min_frequency: int = 2,
                     model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """One byte-level BPE for both languages (shared embeddings need a shared vocabulary). Every encoded sequence
    ends with </s>; decoding is lossless, so detokenised hypotheses go straight to sacreBLEU."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[PAD, BOS, EOS, UNK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for batch in pairs.iter(batch_size=1000):
            for pair in batch["translation"]:
                for lang in languages:
                    yield pair[lang]

    tokenizer.train_from_iterator(texts(), trainer=trainer, length=2 * len(pairs))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[
        (EOS, tokenizer.token_to_id(EOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)


def load_or_train_tokenizer(args, raw, accelerator):
    """--tokenizer_name (a folder or Hub id), else the checkpoint's tokenizer, else OUTPUT_DIR/tokenizer when an
    earlier (resumed) run trained one, else a new BPE trained on the training pairs by the main process."""
    name = args.tokenizer_name or args.model_name_or_path
    if name:
        return AutoTokenizer.from_pretrained(name)
    saved = Path(args.output_dir) / "tokenizer"
    with accelerator.main_process_first():
        if not (saved / "tokenizer.json").is_file():
            tokenizer = train_shared_bpe(raw["train"], (args.source_lang, args.target_lang), args.bpe_vocab_size,
                                         args.bpe_min_frequency)
            tokenizer.save_pretrained(saved)
        return AutoTokenizer.from_pretrained(saved)


def tokenize_pairs(raw, tokenizer, args):
    """input_ids / attention_mask from the source, labels from the target (each ending with </s>), truncated."""
    src, tgt = args.source_lang, args.target_lang

    def encode(batch):
        sources = [pair[src] for pair in batch["translation"]]
        targets = [pair[tgt] for pair in batch["translation"]]
        features = tokenizer(sources, max_length=args.max_source_length, truncation=True)
        features["labels"] = tokenizer(text_target=targets, max_length=args.max_target_length,
                                       truncation=True)["input_ids"]
        return features

    return {split: raw[split].map(encode, batched=True, remove_columns=raw[split].column_names,
                                  desc=f"tokenizing {split}")
            for split in raw}


def references(raw_split, target_lang: str) -> list[str]:
    return [pair[target_lang] for pair in raw_split["translation"]]
