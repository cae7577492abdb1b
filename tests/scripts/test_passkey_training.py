"""Passkey sequences as training data (issue 36): drawn afresh every epoch and exactly again on resume, the key placed
beyond a minimum distance, the answer tokens weighted in train_lm.py's loss, and the options checked."""

import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnzoo.evaluation.passkey import NEEDLE, passkey_training_block
from attnzoo.tokenization import byte_level_tokenizer
from attnzoo.training.lm_loss import answer_weighted_lm_loss
from attnzoo.training.text_data import (
    PasskeyDraws,
    TokenBlocks,
    check_passkey_options,
    count_passkey_blocks,
    with_passkey_blocks,
)
from tests.scripts_helpers import (
    QUIET,
    assert_identical_weights,
    copy_interrupted_run,
    english_text,
    results,
    run_script,
    tiny_model,
    weights,
)

TOKENIZER = byte_level_tokenizer()


def key_distance(ids: torch.Tensor, answer_mask: torch.Tensor) -> int:
    """Tokens from the key line's first token (its leading newline) to the first answer token (byte-level ids)."""
    text = bytes(ids.tolist()).decode()
    return int(answer_mask.nonzero()[0]) - (text.index(NEEDLE.split("{key}")[0]) - 1)


def test_draws_are_new_every_epoch_and_the_same_for_the_same_epoch():
    draws = PasskeyDraws(TOKENIZER, 160, 6, seed=4)
    first = [draws[i]["input_ids"] for i in range(6)]
    assert len({bytes(x.tolist()) for x in first}) == 6
    draws.set_epoch(1)
    second = [draws[i]["input_ids"] for i in range(6)]
    assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    again = PasskeyDraws(TOKENIZER, 160, 6, seed=4)
    again.set_epoch(1)
    assert all(torch.equal(again[i]["input_ids"], second[i]) for i in range(6))
    item = draws[0]
    assert item["input_ids"].shape == item["answer_mask"].shape == (160,)
    answer = bytes(item["input_ids"][item["answer_mask"]].tolist()).decode()
    assert re.fullmatch(r" \d{5}\.", answer) and item["answer_mask"][-len(answer):].all()  # the key, and its end


def test_min_distance_spreads_the_key_beyond_the_window():
    # The key line and the question alone put the key ~100 byte tokens before the answer; 150 moves it further.
    rng = random.Random(0)
    distances = [key_distance(*passkey_training_block(TOKENIZER, 256, rng, task_description=False, min_distance=150))
                 for _ in range(200)]
    assert min(distances) > 150
    longest = 256 - 7  # the key line right after the start, the answer (" 12345.") its last 7 tokens
    assert max(distances) >= longest - 10  # the far end is reached ...
    near = sum(d <= 150 + (longest - 150) / 2 for d in distances)
    assert 70 <= near <= 130  # ... and the distances are spread evenly, not bunched at one end
    anywhere = [key_distance(*passkey_training_block(TOKENIZER, 256, rng, task_description=False))
                for _ in range(200)]
    assert min(anywhere) < 120  # without it, keys also fall as near as the question allows


def test_text_and_passkeys_collate_with_an_answer_mask_and_bad_options_say_what_to_change():
    text = TokenBlocks(torch.tensor(list(english_text()[:12_800])), 128)  # 100 blocks
    mixed = with_passkey_blocks(text, 0.2, TOKENIZER, 128, seed=1, min_distance=40)
    assert count_passkey_blocks(mixed) == 25
    batch = torch.utils.data.default_collate([mixed[0], mixed[110]])
    assert batch["answer_mask"][0].sum() == 0 and batch["answer_mask"][1].sum() > 0
    with pytest.raises(ValueError, match=r"--passkey_min_distance=128 is invalid.*below --block_size=128"):
        check_passkey_options(0.5, 128, 128)
    with pytest.raises(ValueError, match="--passkey_answer_weight=0.0 is invalid"):
        check_passkey_options(0.5, 0, 128, 0.0)
    with pytest.raises(ValueError, match=r"--passkey_answer_weight shape.*--passkey_fraction is 0"):
        check_passkey_options(0.0, 0, 128, 30.0)
    with pytest.raises(ValueError, match=r"min_distance=125 leaves no room for the key"):
        with_passkey_blocks(text, 0.2, TOKENIZER, 128, seed=1, min_distance=125)


def test_the_weighted_loss_is_the_models_own_at_weight_one_and_a_weighted_mean_otherwise():
    from attnzoo import ZooSoftmaxConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ZooSoftmaxConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        is_decoder=True, max_position_embeddings=64)).eval()
    ids = torch.randint(0, 256, (2, 20))
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[:, -3:] = True
    logits = model(ids).logits
    own = model(ids, labels=ids).loss
    torch.testing.assert_close(answer_weighted_lm_loss(logits, ids, mask, 1.0), own, rtol=1e-6, atol=1e-6)
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1),
                                                  reduction="none").view(2, 19)
    answers, others = per_token[mask[:, 1:]], per_token[~mask[:, 1:]]
    expected = (10 * answers.sum() + others.sum()) / (10 * answers.numel() + others.numel())
    torch.testing.assert_close(answer_weighted_lm_loss(logits, ids, mask, 10.0), expected, rtol=1e-6, atol=1e-6)


def _passkey_run_args(corpus, out):
    return ["--train_file", corpus, "--block_size", "128", "--max_train_steps", "8", "--checkpointing_steps", "4",
            "--heldout_fraction", "0.2", "--logging_steps", "2", "--max_eval_batches", "1", "--output_dir", out,
            "--passkey_fraction", "0.5", "--passkey_min_distance", "40", "--passkey_answer_weight", "20",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--num_warmup_steps", "2",
            "--learning_rate", "3e-3", "--sample_tokens", "0", *QUIET, *tiny_model("softmax")]


def test_train_lm_with_weighted_passkeys_resumes_exactly_across_an_epoch(tmp_path):
    """10 text blocks + 10 passkey draws / batch 4 = 5 steps an epoch: the checkpoint at step 4 is in epoch 0, the
    end in epoch 1, whose draws are new; the resumed run must draw them as the uninterrupted one did."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(english_text()[:1600])
    run_script("train_lm", _passkey_run_args(corpus, tmp_path / "full"))
    assert results(tmp_path / "full")["num_passkey_sequences"] == 10
    resumed = tmp_path / "resumed"
    copy_interrupted_run(tmp_path / "full", resumed, 4)
    run_script("train_lm", [*_passkey_run_args(corpus, resumed), "--resume_from_checkpoint", "latest"])
    assert_identical_weights(weights(tmp_path / "full"), weights(resumed))
    with pytest.raises(ValueError, match="--passkey_answer_weight shape passkey sequences"):
        run_script("train_lm", ["--train_file", corpus, "--output_dir", tmp_path / "bad", "--passkey_answer_weight",
                                "20", *QUIET, *tiny_model("softmax")])
    assert not (tmp_path / "bad").exists()


def test_the_training_loop_tells_the_data_its_epoch_also_when_resuming():
    from accelerate import Accelerator

    from attnzoo.training.loop import train_batches, train_loader

    class EpochItems(torch.utils.data.Dataset):
        """Items that say which epoch they were drawn in."""

        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.tensor([self.epoch])

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(train_loader(EpochItems(), 2, seed=0))
    batches = train_batches(accelerator, loader, start_step=0)
    assert [int(next(batches)[0]) for _ in range(5)] == [0, 0, 1, 1, 2]  # two steps an epoch
    loader = accelerator.prepare(train_loader(EpochItems(), 2, seed=0))  # a fresh process, resumed after step 3
    assert int(next(train_batches(accelerator, loader, start_step=3))[0]) == 1
