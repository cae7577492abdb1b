"""Passkey retrieval (attnzoo.evaluation.passkey and benchmarks/passkey_retrieval.py): the prompts are exact and
deterministic, the scoring/batching/padding is checked against an oracle that reads the key from its input, a tiny
random attnzoo model runs within and beyond its position table, the training blocks end with the answer, and the
benchmark script writes its JSON and heatmaps."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from attnzoo import ZooSoftmaxConfig, ZooSoftmaxForCausalLM
from attnzoo.evaluation import passkey as pk
from attnzoo.tokenization import byte_level_tokenizer
from tests.scripts_helpers import ROOT, load_module

TOKENIZER = byte_level_tokenizer()
#: the byte-level tokenizer's fixed pieces: task description 149 bytes, key line 60 (5 digits), question 38
MINIMUM = 247


def tiny_model(max_positions: int = 320) -> ZooSoftmaxForCausalLM:
    torch.manual_seed(0)
    config = ZooSoftmaxConfig(vocab_size=261, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=max_positions, bos_token_id=257,
                              eos_token_id=258, pad_token_id=256)
    return ZooSoftmaxForCausalLM(config).eval()


class Oracle:
    """Stands in for a causal LM: its `generate` answers with the digits that follow "pass key is" in its input (so
    accuracy must be 100%), except where the key line starts after the fraction `wrong_after` of the text, where it
    changes the last digit. It checks what a real model needs: left padding (every row ends with the question), pad
    ids only where the mask is 0, greedy decoding, eval mode; it returns prompt + new tokens as generate() does, and
    can run out of memory above a batch size or refuse long inputs as attnzoo's learned positions do."""

    def __init__(self, tokenizer, wrong_after: float = 2.0, fail_batches_over: int | None = None,
                 refuse_longer_than: int | None = None):
        self.tokenizer, self.wrong_after = tokenizer, wrong_after
        self.fail_batches_over, self.refuse_longer_than = fail_batches_over, refuse_longer_than
        self.batch_sizes, self.training = [], True

    def eval(self):
        self.training = False
        return self

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def generate(self, input_ids, attention_mask, do_sample, max_new_tokens, pad_token_id):
        assert not do_sample and not self.training
        self.batch_sizes.append(len(input_ids))
        if self.fail_batches_over is not None and len(input_ids) > self.fail_batches_over:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.refuse_longer_than is not None and input_ids.shape[1] > self.refuse_longer_than:
            raise ValueError(f"the sequence needs {input_ids.shape[1]} positions but max_position_embeddings="
                             f"{self.refuse_longer_than}; shorten the input or build the model with a larger one.")
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            assert mask[-1] == 1 and bool((mask.cummax(0).values == mask).all()), "not left-padded"
            assert (ids[mask == 0] == pad_token_id).all()
            text = self.tokenizer.decode(ids[mask == 1])
            assert text.endswith(pk.QUESTION)
            key = re.search(r"pass key is (\d+)\.", text).group(1)
            start = text.index("The pass key is") / len(text)  # where the key sits (roughly the depth)
            if start > self.wrong_after:
                key = key[:-1] + str((int(key[-1]) + 1) % 10)
            new = pk._encode(self.tokenizer, f" {key}. The")[:max_new_tokens]
            new += [pad_token_id] * (max_new_tokens - len(new))
            rows.append(torch.cat([ids, torch.tensor(new)]))
        return torch.stack(rows)


# -- prompts -----------------------------------------------------------------------------------------------------
def test_prompts_are_exact_long_deterministic_and_put_the_key_at_the_depth():
    head = len(pk._description(TOKENIZER))
    question = len(pk._encode(TOKENIZER, "\n" + pk.QUESTION))
    assert pk.minimum_length(TOKENIZER) == MINIMUM
    for length in (MINIMUM, 300, 1024):
        for depth in (0, 0.25, 0.5, 1):
            prompt = pk.passkey_prompt(TOKENIZER, length, depth, seed=7)
            # the rule: exactly `length` tokens, for any tokenizer (the filler is cut to the tokens left)
            assert len(prompt.input_ids) == length and prompt.filler_tokens == length - MINIMUM
            assert prompt == pk.passkey_prompt(TOKENIZER, length, depth, seed=7)
            assert re.fullmatch(r"[1-9]\d{4}", prompt.passkey)
            assert prompt.answer_ids == list(f" {prompt.passkey}".encode())
            text = TOKENIZER.decode(prompt.input_ids)
            assert text.startswith(pk.TASK_DESCRIPTION) and text.endswith("\n" + pk.QUESTION)
            line = TOKENIZER.decode(prompt.input_ids[prompt.key_position:prompt.key_end])
            assert line == "\n" + pk.NEEDLE.format(key=prompt.passkey) + "\n"
            assert prompt.key_position == head + round(depth * prompt.filler_tokens)
            if prompt.filler_tokens:  # the requested depth, to the nearest token
                assert abs(prompt.depth - depth) <= 0.5 / prompt.filler_tokens + 1e-12
        start = pk.passkey_prompt(TOKENIZER, length, 0.0, seed=7)
        end = pk.passkey_prompt(TOKENIZER, length, 1.0, seed=7)
        assert start.key_position == head  # right after the task description
        assert end.key_end == length - question  # right before the question
    keys = {pk.passkey_prompt(TOKENIZER, 300, 0.5, seed=s).passkey for s in range(20)}
    assert len(keys) > 15
    assert pk.passkey_prompt(TOKENIZER, 300, 0.5, seed=1, digits=8, passkey=None).passkey.isdigit()
    assert len(pk.passkey_prompt(TOKENIZER, 300, 0.5, seed=1, digits=8).passkey) == 8


def test_prompt_options_corpus_filler_and_no_task_description():
    short = pk.passkey_prompt(TOKENIZER, 120, 0.5, seed=3, task_description=False)
    assert len(short.input_ids) == 120 and TOKENIZER.decode(short.input_ids).startswith("The grass i\nThe pass key")
    assert pk.minimum_length(TOKENIZER, task_description=False) == MINIMUM - len(pk._description(TOKENIZER))
    corpus = pk.passkey_prompt(TOKENIZER, 800, 0.5, seed=3, filler="corpus")
    again = pk.passkey_prompt(TOKENIZER, 800, 0.5, seed=3, filler="corpus")
    other = pk.passkey_prompt(TOKENIZER, 800, 0.5, seed=4, filler="corpus")
    assert corpus == again and corpus.input_ids != other.input_ids and len(corpus.input_ids) == 800
    text = TOKENIZER.decode(corpus.input_ids)
    assert pk.DEFAULT_FILLER not in text and re.findall(r"\d+", text) == [corpus.passkey] * 2
    # a random.Random can be passed instead of a seed, and is drawn from
    rng = random.Random(5)
    assert pk.passkey_prompt(TOKENIZER, 300, 0.5, rng).passkey != pk.passkey_prompt(TOKENIZER, 300, 0.5, rng).passkey


def test_shifted_filler_starts_the_repetition_at_a_drawn_token():
    """`repeat_shifted`: the repeated sentence from a token drawn per prompt, so that prompts of one length and
    depth are cut differently around the key line; `repeat` is unchanged (always from the sentence's start)."""
    unit = TOKENIZER.encode(pk.DEFAULT_FILLER + " ", add_special_tokens=False)
    plain = pk.passkey_prompt(TOKENIZER, 600, 0.5, seed=3, task_description=False)
    filler = plain.input_ids[:plain.key_position]
    assert filler == (unit * 10)[:len(filler)]
    starts = set()
    for seed in range(12):
        shifted = pk.passkey_prompt(TOKENIZER, 600, 0.5, seed=seed, filler="repeat_shifted", task_description=False)
        again = pk.passkey_prompt(TOKENIZER, 600, 0.5, seed=seed, filler="repeat_shifted", task_description=False)
        assert shifted == again and len(shifted.input_ids) == 600
        assert shifted.passkey == pk.passkey_prompt(TOKENIZER, 600, 0.5, seed=seed, task_description=False).passkey
        before = shifted.input_ids[:shifted.key_position]
        start = next(i for i in range(len(unit)) if (unit * 12)[i:i + len(before)] == before)
        after = shifted.input_ids[shifted.key_end:-len(pk._encode(TOKENIZER, "\n" + pk.QUESTION))]
        assert (unit * 12)[start + len(before):start + len(before) + len(after)] == after  # one repetition, cut
        starts.add(start)
    assert len(starts) > 6
    with pytest.raises(ValueError, match="repeat_shifted"):
        pk.passkey_prompt(TOKENIZER, 600, 0.5, filler="shifted")


def bpe_tokenizer():
    """A small BPE tokenizer (several bytes per token) that starts every text with <s>, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([pk.DEFAULT_FILLER, pk.TASK_DESCRIPTION, pk.NEEDLE, pk.QUESTION] * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def test_lengths_and_depths_are_in_the_tokenizers_own_tokens():
    bpe = bpe_tokenizer()
    minimum = pk.minimum_length(bpe)
    assert minimum < MINIMUM / 2  # several bytes per token
    question = len(pk._encode(bpe, "\n" + pk.QUESTION))
    for depth in (0, 0.5, 1):
        prompt = pk.passkey_prompt(bpe, 200, depth, seed=1)
        assert len(prompt.input_ids) == 200 and prompt.input_ids[0] == bpe.bos_token_id  # its own start token
        assert bpe.decode(prompt.input_ids[prompt.key_position:prompt.key_end]) == (
            "\n" + pk.NEEDLE.format(key=prompt.passkey) + "\n")
        assert bpe.decode(prompt.answer_ids) == " " + prompt.passkey
    assert pk.passkey_prompt(bpe, 200, 0, seed=1).key_position == 1 + len(pk._description(bpe))
    assert pk.passkey_prompt(bpe, 200, 1, seed=1).key_end == 200 - question
    result = pk.passkey_accuracy(Oracle(bpe), bpe, [minimum, 200], [0, 1], trials=2, batch_size=3)
    assert result["accuracy"] == {str(minimum): {"0": 1.0, "1": 1.0}, "200": {"0": 1.0, "1": 1.0}}
    blocks = pk.passkey_training_blocks(bpe, 100, 3, seed=0)
    assert blocks.shape == (3, 100) and (blocks[:, 0] == bpe.bos_token_id).all()
    assert all(bpe.decode(row).endswith(" " + re.search(r"key is (\d+)", bpe.decode(row)).group(1) + ".")
               for row in blocks)


def test_bad_prompt_arguments_say_the_fix():
    with pytest.raises(ValueError, match=f"length=200 is too short.*minimum is {MINIMUM} tokens.*task_description"):
        pk.passkey_prompt(TOKENIZER, 200, 0.5)
    for depth in (-0.1, 1.5, float("nan"), "middle"):
        with pytest.raises(ValueError, match=r"depth=.* is outside \[0, 1\]"):
            pk.passkey_prompt(TOKENIZER, 300, depth)
    with pytest.raises(ValueError, match="filler='lorem'"):
        pk.passkey_prompt(TOKENIZER, 300, 0.5, filler="lorem")
    with pytest.raises(ValueError, match="digits=0"):
        pk.passkey_prompt(TOKENIZER, 300, 0.5, digits=0)
    with pytest.raises(ValueError, match="passkey='12a'"):
        pk.passkey_prompt(TOKENIZER, 300, 0.5, passkey="12a")


def test_scoring_is_the_first_run_of_digits():
    assert pk.is_correct(" 12345. The", "12345") and pk.is_correct(" 12345", "12345")
    assert pk.is_correct("\n12345", "12345")
    assert not pk.is_correct(" 1234", "12345") and not pk.is_correct(" 123456", "12345")
    assert not pk.is_correct(" not known", "12345") and not pk.is_correct(" 54321 12345", "12345")


# -- accuracy ----------------------------------------------------------------------------------------------------
def test_an_oracle_scores_100_percent_and_the_cells_are_kept_apart():
    oracle = Oracle(TOKENIZER, wrong_after=0.62)  # wrong where the key line starts in the last 38% of the text
    result = pk.passkey_accuracy(oracle, TOKENIZER, [600, 300], [0, 0.5, 1], trials=3, seed=1, batch_size=4)
    assert result["accuracy"] == {"300": {"0": 1.0, "0.5": 1.0, "1": 0.0}, "600": {"0": 1.0, "0.5": 1.0, "1": 0.0}}
    # one untimed warm-up call, then batches across the depths of a length; train mode is restored
    assert oracle.batch_sizes == [1] + [4, 4, 1] * 2 and oracle.training
    assert result["stopped"] is None and all(c["status"] == "run" for c in result["cells"])
    cell = next(c for c in result["cells"] if c["length"] == 300 and c["depth"] == 0.5)
    assert cell["correct"] == 3 and cell["trials"] == 3 and abs(cell["depth_used"] - 0.5) < 0.01
    assert re.fullmatch(r" \d{5}\. ", cell["samples"][0])  # max_new_tokens = answer + 2
    # trial t uses the same key in every cell; another seed, other keys
    again = pk.passkey_accuracy(Oracle(TOKENIZER), TOKENIZER, [300], [0.5], trials=3, seed=1, batch_size=2)
    assert again["accuracy"] == {"300": {"0.5": 1.0}}
    assert again["cells"][0]["samples"] == cell["samples"][:2]


def test_left_padding():
    # prompts are exactly `length` tokens, so a batch needs padding only if a caller mixes lengths; it is on the left
    pads = pk._pad_left([[1, 2, 3], [4]], 0, "cpu")
    assert pads[0].tolist() == [[1, 2, 3], [0, 0, 4]] and pads[1].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_out_of_memory_halves_the_batch_then_stops():
    oracle = Oracle(TOKENIZER, fail_batches_over=2)
    result = pk.passkey_accuracy(oracle, TOKENIZER, [300, 400], [0, 1], trials=3, batch_size=8)
    assert result["accuracy"] == {"300": {"0": 1.0, "1": 1.0}, "400": {"0": 1.0, "1": 1.0}}
    # warm-up, then 6 prompts: 6 and 4 run out of memory, 2 fits; the longer length starts at 2
    assert oracle.batch_sizes == [1, 6, 4, 2, 2, 2, 2, 2, 2] and result["lengths"]["400"]["batch_size"] == 2
    never = pk.passkey_accuracy(Oracle(TOKENIZER, fail_batches_over=0), TOKENIZER, [300, 400], [0.5], trials=2)
    reason = "not run (out of memory at length 300 with batch size 1)"
    assert never["stopped"] == reason and [c["status"] for c in never["cells"]] == [reason, reason]
    assert never["accuracy"] == {"300": {"0.5": None}, "400": {"0.5": None}}


def test_time_budget_and_position_refusals_stop_longer_lengths():
    timed = pk.passkey_accuracy(Oracle(TOKENIZER), TOKENIZER, [300, 400, 500], [0.5], trials=2, batch_size=2,
                                max_seconds_per_length=0)
    assert timed["accuracy"] == {"300": {"0.5": 1.0}, "400": {"0.5": None}, "500": {"0.5": None}}
    assert timed["stopped"].startswith("not run (length 300 took") and "max_seconds_per_length=0" in timed["stopped"]
    # over budget in the middle of a length: its unfinished cells are not run, its finished ones keep their score
    partial = pk.passkey_accuracy(Oracle(TOKENIZER), TOKENIZER, [300], [0, 1], trials=2, batch_size=2,
                                  max_seconds_per_length=0)
    assert partial["accuracy"] == {"300": {"0": 1.0, "1": None}}
    assert partial["lengths"]["300"]["status"].startswith("partly run: not run (length 300 took")
    # a model that refuses a length itself (attnzoo's ValueError) is recorded, and longer lengths are not tried
    refusing = Oracle(TOKENIZER, refuse_longer_than=350)
    result = pk.passkey_accuracy(refusing, TOKENIZER, [300, 400, 500], [0.5], trials=1)
    assert result["accuracy"] == {"300": {"0.5": 1.0}, "400": {"0.5": None}, "500": {"0.5": None}}
    assert {c["status"] for c in result["cells"][1:]} == {"not run (beyond max_position_embeddings=350)"}
    assert len(refusing.batch_sizes) == 3  # warm-up, 300, 400
    with pytest.raises(ValueError, match="depths=2"):
        pk.passkey_accuracy(Oracle(TOKENIZER), TOKENIZER, [300], [2], trials=1)
    with pytest.raises(ValueError, match="minimum is 247"):
        pk.passkey_accuracy(Oracle(TOKENIZER), TOKENIZER, [100, 300], [0.5], trials=1)
    with pytest.raises(ValueError, match="trials=0"):
        pk.passkey_accuracy(Oracle(TOKENIZER), TOKENIZER, [300], [0.5], trials=0)


def test_a_tiny_attnzoo_model_runs_within_its_positions_and_records_beyond():
    model = tiny_model(max_positions=320)
    assert pk.position_limit(model) == ("max_position_embeddings", 320)
    # 300 + 8 new tokens - 1 fit in 320 positions; 314 + 7 do not; 400 does not either
    result = pk.passkey_accuracy(model, TOKENIZER, [300, 314, 400], [0, 1], trials=2, batch_size=4)
    assert result["accuracy"]["300"] == {"0": 0.0, "1": 0.0}  # random weights: well defined, and wrong
    reason = "not run (beyond max_position_embeddings=320)"
    assert result["accuracy"]["314"] == result["accuracy"]["400"] == {"0": None, "1": None}
    assert result["lengths"]["314"] == {"seconds": None, "batch_size": None, "status": reason, "positions_needed": 321}
    assert {c["status"] for c in result["cells"] if c["length"] > 300} == {reason} and result["stopped"] is None
    assert all(len(c["samples"]) == 2 for c in result["cells"] if c["length"] == 300)
    rotary = ZooSoftmaxConfig(hidden_size=32, num_attention_heads=2, position_embedding_type="rotary")
    assert pk.position_limit(type("Rotary", (), {"config": rotary})()) is None


# -- training data -----------------------------------------------------------------------------------------------
def test_training_blocks_end_with_the_answer():
    blocks, mask = pk.passkey_training_blocks(TOKENIZER, 300, 5, seed=2, with_answer_mask=True)
    assert blocks.shape == mask.shape == (5, 300) and blocks.dtype == torch.long
    assert torch.equal(blocks, pk.passkey_training_blocks(TOKENIZER, 300, 5, seed=2))
    assert not torch.equal(blocks, pk.passkey_training_blocks(TOKENIZER, 300, 5, seed=3))
    for row, answer in zip(blocks, mask, strict=True):
        text = TOKENIZER.decode(row)
        key = re.search(r"pass key is (\d{5})\.", text).group(1)
        assert text.endswith(f"{pk.QUESTION} {key}.")  # the answer ends as the key line's key does: it stops there
        assert TOKENIZER.decode(row[answer]) == f" {key}." and answer[-7:].all() and answer.sum() == 7
    depths = [pk.passkey_prompt(TOKENIZER, 293, d).key_position for d in (0, 1)]  # 300 - the answer
    fixed = pk.passkey_training_blocks(TOKENIZER, 300, 4, depths=[0, 1])
    keys = [TOKENIZER.decode(row).index("\nThe pass key") for row in fixed]
    assert set(keys) <= set(depths)
    assert pk.passkey_training_blocks(TOKENIZER, 120, 2, task_description=False).shape == (2, 120)
    assert pk.passkey_training_blocks(TOKENIZER, 300, 0).shape == (0, 300)
    with pytest.raises(ValueError, match=f"block_size=200 cannot hold.*minimum is {MINIMUM + 7} tokens"):
        pk.passkey_training_blocks(TOKENIZER, 200, 1)
    with pytest.raises(ValueError, match=r"depths=1.5 is outside \[0, 1\]"):
        pk.passkey_training_blocks(TOKENIZER, 300, 1, depths=[1.5])


# -- the benchmark script ------------------------------------------------------------------------------------------
def test_benchmark_end_to_end(tmp_path):
    folder = tmp_path / "tiny softmax"
    tiny_model(max_positions=320).save_pretrained(folder)
    byte_level_tokenizer(320).save_pretrained(folder)
    bench = load_module(ROOT / "benchmarks", "passkey_retrieval")
    out = tmp_path / "passkey.json"
    report = bench.main(["--model", str(folder), "--lengths", "400", "260", "--depths", "0", "0.5", "1",
                         "--trials", "2", "--batch_size", "6", "--results", str(out)])
    assert json.loads(out.read_text()) == report
    result = report["models"]["tiny_softmax"]
    assert result["class"] == "ZooSoftmaxForCausalLM" and result["max_position_embeddings"] == 320
    assert result["accuracy"] == {"260": {"0": 0.0, "0.5": 0.0, "1": 0.0}, "400": {"0": None, "0.5": None, "1": None}}
    assert result["seconds_per_length"]["260"] > 0 and result["seconds_per_length"]["400"] is None
    assert result["not_run"] == [{"length": 400, "depth": d, "reason": "not run (beyond max_position_embeddings=320)"}
                                 for d in (0.0, 0.5, 1.0)]
    assert report["setup"]["lengths"] == [260, 400] and report["command"].startswith(
        "python benchmarks/passkey_retrieval.py --model ")
    png = tmp_path / "passkey_tiny_softmax.png"
    assert result["heatmap"] == str(png) and png.stat().st_size > 0
    # the model card of the folder now carries the figures, as model-index results and a table; a second run
    # replaces them (and keeps what else the card holds)
    from huggingface_hub import ModelCard

    card_path = folder / "README.md"
    assert result["model_card"] == str(card_path)
    card = ModelCard.load(card_path)
    [entry] = [r for r in card.data.eval_results if r.task_name == "passkey retrieval"]
    assert entry.dataset_name == "passkey retrieval, 260 tokens" and entry.metric_value == 0.0
    assert "2 keys per depth" in entry.metric_config and "by depth 0%: 0.00, 50%: 0.00, 100%: 0.00" in \
        entry.metric_config
    assert "## Passkey retrieval" in card.text and "| 260 tokens | 0.0 |" in card.text
    card_path.write_text(card_path.read_text() + "\nmy own notes\n")
    bench.main(["--model", str(folder), "--lengths", "260", "--depths", "0", "--trials", "1", "--results", str(out)])
    card = ModelCard.load(card_path)
    assert [r.metric_config.split("; ")[1] for r in card.data.eval_results] == ["by depth 0%: 0.00"]
    assert card.text.count("## Passkey retrieval") == 1 and "my own notes" in card.text
    bench.main(["--model", str(folder), "--lengths", "260", "--depths", "0", "--trials", "1", "--results", str(out),
                "--model_card", "none"])
    assert ModelCard.load(card_path).text == card.text
