"""Attention transfer (attnzoo/training/attention_transfer.py, scripts/transfer_attention.py) and LoRA fine-tuning
(attnzoo/training/lora.py, scripts/train_lm.py --lora_r): the captured teacher attention equals a softmax student's
exactly (GPT-2, Llama and attnzoo teachers, padded rows included), the transfer loss falls for a learned-FAVOR+ and
a LARA-landmark student while nothing but their own parameters changes, a hybrid skips its softmax layers, the
script end to end with exact resume and its nothing-to-learn exit, and LoRA runs that train only adapters and save a
merged model that a fresh process loads through its remote code. Models are tiny GPT-2s with random weights (no
network), converted with attnzoo.convert.gpt2."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import attnzoo  # noqa: F401  (registers the families)
from attnzoo.convert import gpt2
from attnzoo.tokenization import byte_level_tokenizer
from attnzoo.training.attention_transfer import (
    AttentionTransfer,
    evaluate_transfer,
    find_attention_layers,
    masked_mse,
)
from tests.scripts_helpers import (
    QUIET,
    ROOT,
    SCRIPTS,
    assert_identical_weights,
    copy_interrupted_run,
    english_text,
    launch,
    launched,
    max_weight_difference,
    results,
    run_script,
    script_env,
    weights,
)

VOCAB = len(byte_level_tokenizer())
LEARNED_FAVOR = {"num_random_features": 16, "feature_redraw": "learned", "linear_attention_chunk_size": 16}
LARA_LANDMARKS = {"lara_landmark_transform": True, "lara_num_samples": 4, "lara_chunk_size": 8}
HYBRID = {"attn_layers": ["favor", "full"], **LEARNED_FAVOR}


def tiny_gpt2(seed: int = 0, layers: int = 2) -> GPT2LMHeadModel:
    """A GPT-2 with random weights scaled as in a trained model: query and key weights so that its attention is
    peaked (at initialisation every attention is close to a plain average, which any student matches), value and
    output weights so that attention outputs are of order 0.1, not 1e-4 (MSEs of 1e-8 would meet AdamW's epsilon)."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=layers, n_head=4, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :2 * config.n_embd] *= 4.0
            block.attn.c_attn.weight[:, 2 * config.n_embd:] *= 20.0
            block.attn.c_proj.weight *= 20.0
    return model


def token_ids(batch: int = 4, length: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded_mask(batch: int = 4, length: int = 48) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, :9] = False
    mask[2, :3] = False
    return mask


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders: the GPT-2 source (with the byte-level tokenizer) and its conversions, built on first use."""
    root = tmp_path_factory.mktemp("transfer_models")
    source = root / "gpt2"
    tiny_gpt2().save_pretrained(source)
    byte_level_tokenizer().save_pretrained(source)
    made = {"gpt2": source}

    def folder(name: str, family: str = "softmax", options: dict | None = None):
        if name not in made:
            pairs = [f"{key}={json.dumps(value).replace(' ', '')}" for key, value in (options or {}).items()]
            gpt2.main([str(source), str(root / name), "--family", family, "--model", *pairs])
            made[name] = root / name
        return made[name]

    return folder


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def changed_keys(before: dict, after: dict) -> list[str]:
    assert before.keys() == after.keys()
    return sorted(name for name in before if not torch.equal(before[name], after[name]))


def own_keys(student: nn.Module) -> list[str]:
    return sorted(f"model.transformer.blocks.{i}.attn.{name}"
                  for i, attn in enumerate(find_attention_layers(student))
                  for name, _ in attn.own_parameters())


def train_transfer(transfer: AttentionTransfer, steps: int, seed: int = 0) -> None:
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(transfer.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(steps):
        transfer(token_ids(seed=100 + step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


# -- what the teacher's attention is --------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
def test_a_softmax_students_attention_equals_the_gpt2_teachers(padded):
    """The captured input and output of GPT-2's `transformer.h[i].attn` are those of the zoo's
    `blocks[i].attn`: a softmax student converted from the teacher reproduces every layer (left-padded rows too)."""
    teacher = tiny_gpt2()
    transfer = AttentionTransfer(teacher, gpt2.convert(teacher, "softmax"), layers=[0, 1])
    with torch.no_grad():
        loss = transfer(token_ids(), left_padded_mask() if padded else None)
    assert loss.per_layer.shape == (2,)
    assert loss.per_layer.max().item() < 1e-12
    # and the loss is not vacuous: a changed output projection shows in its layer only
    with torch.no_grad():
        transfer.student.model.transformer.blocks[1].attn.o_proj.weight.mul_(1.5)
        moved = transfer(token_ids()).per_layer
    assert moved[0].item() < 1e-12 < 1e-9 < moved[1].item()


def test_a_softmax_students_attention_equals_a_llama_teachers():
    """Llama's `model.layers[i].self_attn` (keyword arguments, rotary positions, grouped key/value heads): the
    student gets the positions of real tokens, as the teacher does here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = pytest.importorskip("attnzoo.convert.llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    teacher = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    student = llama.convert(teacher, "softmax")
    assert student.model.transformer.blocks[0].attn.rotary is not None
    transfer = AttentionTransfer(teacher, student, layers=[0, 1])
    with torch.no_grad():
        assert transfer(token_ids(), left_padded_mask()).per_layer.max().item() < 1e-10
        learned = AttentionTransfer(teacher, llama.convert(teacher, "performer", LEARNED_FAVOR))
        assert learned.layers == (0, 1) and learned(token_ids()).per_layer.min().item() > 1e-8


def test_an_attnzoo_softmax_teacher_gives_the_gpt2_teachers_losses():
    """A teacher that is itself an attnzoo model (the GPT-2 converted to softmax: the same function) gives the same
    per-layer losses for the same student."""
    source = tiny_gpt2()
    student = gpt2.convert(source, "performer", LEARNED_FAVOR)
    zoo_teacher = gpt2.convert(source, "softmax")
    ids, mask = token_ids(), left_padded_mask()
    with torch.no_grad():
        from_gpt2 = AttentionTransfer(source, student)(ids, mask).per_layer
        from_zoo = AttentionTransfer(zoo_teacher, student)(ids, mask).per_layer
    assert from_gpt2.min().item() > 1e-8  # FAVOR+ with 16 features is far from exact
    torch.testing.assert_close(from_zoo, from_gpt2, rtol=1e-5, atol=0)


# -- training the own parameters ------------------------------------------------------------------------------
# FAVOR+'s projection sets the whole kernel, LARA's landmark transforms only where its proposals sit (their means
# carry the source's own queries and keys): 40 steps cut the first loss by ~75%, the second by 4-13% here.
@pytest.mark.parametrize("family,options,ratio", [("performer", LEARNED_FAVOR, 0.5), ("lara", LARA_LANDMARKS, 0.98)],
                         ids=["learned_favor", "lara_landmarks"])
def test_transfer_lowers_the_loss_and_changes_only_own_parameters(family, options, ratio):
    teacher = tiny_gpt2()
    student = gpt2.convert(teacher, family, options)
    teacher_before, student_before = state(teacher), state(student)
    transfer = AttentionTransfer(teacher, student)
    assert transfer.layers == (0, 1)
    trained = {id(p) for p in transfer.parameters()}
    assert trained == {id(p) for attn in find_attention_layers(student) for _, p in attn.own_parameters()}
    assert all(p.requires_grad == (id(p) in trained) for p in student.parameters())
    assert not any(p.requires_grad for p in teacher.parameters())
    assert sorted(transfer.state_dict()) == sorted(f"own.layer{key.split('.')[3]}/"
                                                   + "/".join(key.split(".")[5:]) for key in own_keys(student))
    held_out = token_ids(batch=8, seed=7)
    with torch.no_grad():
        before = transfer(held_out).per_layer
    train_transfer(transfer, steps=40)
    with torch.no_grad():
        after = transfer(held_out).per_layer
    assert (after < ratio * before).all(), (before, after)
    assert changed_keys(student_before, state(student)) == own_keys(student)
    assert changed_keys(teacher_before, state(teacher)) == []


def test_a_hybrid_student_runs_only_its_learned_layers():
    """attn_layers [favor, full]: layer 1 (softmax) has nothing to learn, so neither the student's nor the teacher's
    attention of layer 1 runs (the teacher stops after layer 0)."""
    teacher = tiny_gpt2()
    student = gpt2.convert(teacher, "hybrid", HYBRID)
    transfer = AttentionTransfer(teacher, student)
    assert transfer.layers == (0,) and transfer.kinds == ("favor", "full")
    calls = []
    hooks = [module.register_forward_hook(lambda module, args, out, name=name: calls.append(name))
             for name, module in (("teacher_0", teacher.transformer.h[0].attn), ("teacher_1", teacher.transformer.h[1]),
                                  ("student_0", student.model.transformer.blocks[0].attn),
                                  ("student_1", student.model.transformer.blocks[1].attn),
                                  ("teacher_head", teacher.lm_head))]
    loss = transfer(token_ids())
    for hook in hooks:
        hook.remove()
    assert loss.per_layer.shape == (1,) and sorted(calls) == ["student_0", "teacher_0"]
    loss.loss.backward()
    assert student.model.transformer.blocks[0].attn.learned_projection.grad is not None
    assert all(p.grad is None for p in student.model.transformer.blocks[1].parameters())


def test_padded_positions_do_not_count():
    prediction, target = torch.zeros(2, 3, 4), torch.ones(2, 3, 4)
    target[0, 0] = 100.0  # a padded position: ignored
    weights = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert masked_mse(prediction, target, weights).item() == 1.0
    assert masked_mse(prediction, target, None).item() > 1000


def test_models_that_do_not_pair_are_refused():
    teacher = tiny_gpt2()
    with pytest.raises(ValueError, match="the teacher has 3 attention layers and the student 2"):
        AttentionTransfer(tiny_gpt2(layers=3), gpt2.convert(teacher, "performer", LEARNED_FAVOR))
    with pytest.raises(ValueError, match="teacher: Sequential has no list of layers holding a self-attention"):
        AttentionTransfer(nn.Sequential(nn.Linear(2, 2)), gpt2.convert(teacher, "softmax"))
    with pytest.raises(ValueError, match="not attnzoo attentions; convert the source first"):
        AttentionTransfer(teacher, tiny_gpt2(seed=1))
    with pytest.raises(ValueError, match=r"layers=\[5\] is invalid"):
        AttentionTransfer(teacher, gpt2.convert(teacher, "softmax"), layers=[5])
    with pytest.raises(ValueError, match=r"no attention layer has parameters of its own \(layers: \['ra', 'ra'\]\)"):
        AttentionTransfer(teacher, gpt2.convert(teacher, "ra"))


def test_held_out_evaluation_is_the_mean_over_batches():
    from accelerate import Accelerator

    teacher = tiny_gpt2()
    transfer = AttentionTransfer(teacher, gpt2.convert(teacher, "lara", LARA_LANDMARKS))
    ids = token_ids(batch=6, seed=3)
    loader = [{"input_ids": ids[:4]}, {"input_ids": ids[4:]}]
    with torch.no_grad():
        expected = (transfer(ids[:4]).per_layer * 4 + transfer(ids[4:]).per_layer * 2) / 6
    found = evaluate_transfer(transfer, loader, Accelerator(cpu=True))
    torch.testing.assert_close(torch.tensor(found, dtype=torch.float32), expected, rtol=1e-5, atol=0)


# -- scripts/transfer_attention.py --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("transfer_corpus") / "corpus.txt"
    path.write_bytes(english_text()[:6_000])
    return path


def transfer_args(models, corpus, out, student="perf", family="performer", options=LEARNED_FAVOR, *extra):
    return ["--teacher", models("gpt2"), "--student", models(student, family, options), "--train_file", corpus,
            "--block_size", "32", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
            "--heldout_fraction", "0.1", "--max_train_steps", "12", "--logging_steps", "4", "--output_dir", out,
            *QUIET, *extra]


def test_script_transfers_and_saves_the_student(tmp_path, models, corpus):
    out = tmp_path / "run"
    returned = run_script("transfer_attention", transfer_args(models, corpus, out))
    found = results(out)
    assert found == json.loads(json.dumps(returned))
    assert found["transferred_layers"] == [0, 1] and found["skipped_layers"] == []
    assert found["train_steps"] == 12 and found["num_trained_parameters"] == 2 * 4 * 16 * 8
    before, after = found["per_layer_transfer_loss_before"], found["per_layer_transfer_loss_after"]
    assert set(before) == set(after) == {"0", "1"}
    assert all(after[layer] < before[layer] for layer in before)
    assert found["transfer_loss_after"] == pytest.approx(sum(after.values()) / 2)
    # the student with its trained projections; every other weight exactly as converted
    student = weights(models("perf"))
    saved = weights(out)
    assert changed_keys(student, saved) == ["model.transformer.blocks.0.attn.learned_projection",
                                           "model.transformer.blocks.1.attn.learned_projection"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "attnzoo_performer" and (out / "tokenizer.json").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [4, 8, 12]


def test_script_resumes_to_identical_weights(tmp_path, models, corpus):
    """LARA's training forward draws samples from the global RNG and the run accumulates gradients over 2
    micro-batches: a run resumed from its step-4 checkpoint must end bit-identical to the uninterrupted one. The
    checkpoint holds only the trained parameters (and their optimizer state)."""
    args = ("lara", "lara", LARA_LANDMARKS, "--checkpointing_steps", "4", "--gradient_accumulation_steps", "2",
            "--max_train_steps", "8")
    full = tmp_path / "full"
    run_script("transfer_attention", transfer_args(models, corpus, full, *args))
    checkpoint = full / "checkpoints" / "step_4"
    assert len(weights(checkpoint)) == 2 * 8  # per layer: the two landmark transforms' Linear and LayerNorm
    resumed = tmp_path / "resumed"
    copy_interrupted_run(full, resumed, 4)
    run_script("transfer_attention", [*transfer_args(models, corpus, resumed, *args),
                                      "--resume_from_checkpoint", "latest"])
    assert_identical_weights(weights(full), weights(resumed))
    assert results(resumed)["per_layer_transfer_loss_after"] == results(full)["per_layer_transfer_loss_after"]
    # the before-loss is the converted student's, also in the resumed run
    assert results(resumed)["transfer_loss_before"] == results(full)["transfer_loss_before"]
    with pytest.raises(ValueError, match=r"cannot resume with different settings: --student"):
        run_script("transfer_attention", [*transfer_args(models, corpus, resumed, "perf", "performer", LEARNED_FAVOR,
                                                         "--max_train_steps", "9"),
                                          "--resume_from_checkpoint", "latest"])


def test_a_hybrid_run_transfers_only_the_learned_layers(tmp_path, models, corpus):
    """...from a teacher that is an attnzoo model itself (the GPT-2 converted to softmax)."""
    out = tmp_path / "run"
    found = run_script("transfer_attention", [*transfer_args(models, corpus, out, "hybrid", "hybrid", HYBRID,
                                                             "--max_train_steps", "4", "--max_eval_batches", "2"),
                                              "--teacher", models("softmax")])
    assert found["teacher"] == str(models("softmax")) and found["layer_kinds"] == ["favor", "full"]
    assert found["transferred_layers"] == [0] and found["skipped_layers"] == [1]
    assert list(found["per_layer_transfer_loss_after"]) == ["0"]
    assert changed_keys(weights(models("hybrid")), weights(out)) == [
        "model.transformer.blocks.0.attn.learned_projection"]


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_doubled_batch(tmp_path, models, corpus):
    """DDP over gloo: the transfer module's parameters are the students' own ones, shared with the student, and
    their gradients are averaged over both shards."""
    def args(out, batch):  # one thread a process: the three processes share two cores
        return [*transfer_args(models, corpus, out), "--max_train_steps", "6", "--per_device_train_batch_size", batch,
                "--cpu_threads", "1"]

    with launched("transfer_attention", args(tmp_path / "one", "4")) as one:
        two = launch("transfer_attention", args(tmp_path / "two", "2"), num_processes=2)  # beside the one-process run
        one.wait()
    assert "2 process(es)" in two.stdout and results(tmp_path / "two")["num_processes"] == 2
    one_weights, two_weights = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert max_weight_difference(one_weights, two_weights) < 1e-6
    assert max_weight_difference(weights(models("perf")), two_weights) > 1e-3  # training moved them by far more


@pytest.mark.parametrize("family,options", [("ra", {}), ("performer", {"num_random_features": 16}),
                                            ("lara", {"lara_landmark_transform": False})],
                         ids=["ra", "favor_fixed", "lara_plain"])
def test_a_student_with_nothing_to_learn_is_sent_to_fine_tuning(tmp_path, models, corpus, capsys, family, options):
    out = tmp_path / "run"
    found = run_script("transfer_attention", transfer_args(models, corpus, out, f"{family}_plain", family, options))
    assert found["nothing_to_learn"] is True
    message = capsys.readouterr().out
    assert "has nothing to train" in message and "scripts/train_lm.py --model_name_or_path" in message
    assert not out.exists()  # nothing written


def test_the_nothing_to_learn_exit_is_status_zero(tmp_path, models, corpus):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(SCRIPTS / "transfer_attention.py"),
                           *map(str, transfer_args(models, corpus, out, "ra_plain", "ra", {}))],
                          capture_output=True, text=True, env=script_env(), timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Go straight to fine-tuning" in done.stdout and not out.exists()


def test_script_refuses_what_it_cannot_do(tmp_path, models, corpus):
    out = tmp_path / "run"
    other_tokenizer = tmp_path / "other"
    shutil.copytree(models("perf"), other_tokenizer)
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other_tokenizer)
    three_layers = tmp_path / "gpt2_3"
    tiny_gpt2(layers=3).save_pretrained(three_layers)
    byte_level_tokenizer().save_pretrained(three_layers)
    cases = [
        (["--student", other_tokenizer], r"the tokenizers differ: --teacher .* has 261 tokens, --student .* 262"),
        (["--student", models("gpt2")], "is a 'gpt2' model, not an attnzoo one; convert it first"),
        (["--teacher", three_layers], "the teacher has 3 attention layers and the student 2"),
        (["--student", tmp_path / "missing"], "--student .*missing: no such folder"),
        (["--push_to_hub"], "--push_to_hub: the transfer script does not publish"),
        (["--torch_compile"], "--torch_compile"),
        (["--block_size", "100"], "--block_size=100 exceeds --teacher's max_position_embeddings=64"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            run_script("transfer_attention", [*transfer_args(models, corpus, out), *extra])
    assert not (out / "model.safetensors").exists()


# -- LoRA fine-tuning: scripts/train_lm.py --lora_r ----------------------------------------------------------
LORA_ARGS = ["--block_size", "32", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
             "--heldout_fraction", "0.1", "--max_eval_batches", "2", "--learning_rate", "1e-2",
             "--num_warmup_steps", "0", "--sample_tokens", "0", *QUIET]


def lora_run(models, corpus, out, *extra, steps: int = 6):
    return run_script("train_lm", ["--model_name_or_path", models("perf", "performer", LEARNED_FAVOR),
                                   "--train_file", corpus, "--max_train_steps", str(steps), "--output_dir", out,
                                   *LORA_ARGS, *extra])


def test_lora_trains_adapters_only_and_saves_the_merged_model(tmp_path, models, corpus):
    pytest.importorskip("peft")
    out = tmp_path / "run"
    lora_run(models, corpus, out, "--lora_r", "4", "--lora_alpha", "8", "--checkpointing_steps", "6")
    found = results(out)
    # adapters on q, k, v and the output projection of both layers: 2 x 4 x r x (32 + 32)
    assert found["lora_trainable_parameters"] == 2 * 4 * 4 * 64 and found["lora"]["r"] == 4
    base, merged = weights(models("perf")), weights(out)
    assert merged.keys() == base.keys()  # a plain attnzoo checkpoint: no adapter weights left
    projections = [f"model.transformer.blocks.{i}.attn.{p}.weight" for i in (0, 1)
                   for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert changed_keys(base, merged) == sorted(projections)  # biases, norms, features, FFN, embeddings: as they were
    # the merged model equals the adapted model of the last checkpoint, merged here in this process
    from attnzoo.training.lora import add_lora, merge_lora

    settings = SimpleNamespace(lora_r=4, lora_alpha=8.0, lora_dropout=None, lora_target_modules=None)
    adapted = add_lora(AutoModelForCausalLM.from_pretrained(models("perf")), settings)
    missing, unexpected = adapted.load_state_dict(weights(out / "checkpoints" / "step_6"), strict=False)
    assert unexpected == [] and missing == ["model.lm_head.weight"]  # tied to the embedding, saved once
    in_process = merge_lora(adapted).eval()
    ids = token_ids(batch=2, length=24, seed=5)
    with torch.no_grad():
        expected = in_process(ids).logits
    # a fresh process that does not import attnzoo: the checkpoint's own code (trust_remote_code) builds the model
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
        "assert 'attnzoo' not in sys.modules, 'the probe must not use the installed package'\n"
        "assert type(model).__module__.startswith('transformers_modules'), type(model).__module__\n"
        "with torch.no_grad():\n"
        "    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])\n")
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run([sys.executable, str(probe), str(out), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, timeout=300,
                          env=script_env(HF_MODULES_CACHE=str(tmp_path / "modules")), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, AutoModelForCausalLM.from_pretrained(models("perf")).eval()(ids).logits,
                              atol=1e-4), "LoRA changed nothing"


def test_lora_run_resumes_to_identical_weights(tmp_path, models, corpus):
    pytest.importorskip("peft")
    extra = ["--lora_r", "4", "--lora_dropout", "0.1", "--checkpointing_steps", "3"]
    lora_run(models, corpus, tmp_path / "full", *extra)
    resumed = tmp_path / "resumed"
    copy_interrupted_run(tmp_path / "full", resumed, 3)
    lora_run(models, corpus, resumed, *extra, "--resume_from_checkpoint", "latest")
    assert_identical_weights(weights(tmp_path / "full"), weights(resumed))
    with pytest.raises(ValueError, match=r"cannot resume with different settings: --lora_r 8 \(the run in .* used 4"):
        lora_run(models, corpus, resumed, "--lora_r", "8", "--lora_dropout", "0.1",
                 "--resume_from_checkpoint", "latest", steps=7)
    with pytest.raises(ValueError, match=r"--lora_r None \(the run in .* used 4"):
        lora_run(models, corpus, resumed, "--resume_from_checkpoint", "latest", steps=7)


def test_lora_default_targets_follow_each_attentions_names():
    from attnzoo.training.loop import new_model_config
    from attnzoo.training.lora import default_target_names, resolve_target_modules

    def model(family, *overrides):
        config = new_model_config(family, dict(vocab_size=VOCAB, max_position_embeddings=64, is_decoder=True),
                                  ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2", *overrides])
        return AutoModelForCausalLM.from_config(config)

    assert default_target_names(model("softmax")) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert default_target_names(model("reformer", "attn_layers=[local]")) == ["query", "key", "value", "output"]
    assert default_target_names(model("reformer", "attn_layers=[lsh]")) == ["value", "query_key", "output"]
    mixed = model("reformer", "attn_layers=[local,lsh]")
    assert resolve_target_modules(mixed, default_target_names(mixed)) == [
        "model.transformer.blocks.0.attn.query", "model.transformer.blocks.0.attn.key",
        "model.transformer.blocks.0.attn.value", "model.transformer.blocks.0.attn.output",
        "model.transformer.blocks.1.attn.query_key", "model.transformer.blocks.1.attn.value",
        "model.transformer.blocks.1.attn.output"]
    with pytest.raises(ValueError, match=r"--lora_target_modules \['q_prj'\]: no linear layer .* named \["):
        resolve_target_modules(model("softmax"), ["q_prj", "q_proj"])


def test_lora_arguments_are_checked(tmp_path, models, corpus, monkeypatch):
    out = tmp_path / "run"
    cases = [
        (["--lora_alpha", "16"], "--lora_alpha configures LoRA, which --lora_r turns on"),
        (["--lora_target_modules", "q_proj"], "--lora_target_modules configures LoRA"),
        (["--lora_r", "0"], "--lora_r=0 is invalid"),
        (["--lora_r", "8", "--lora_dropout", "1.5"], "--lora_dropout=1.5 is invalid"),
        (["--lora_r", "8", "--lora_alpha", "-1"], "--lora_alpha=-1.0 is invalid"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            lora_run(models, corpus, out, *extra)
    with pytest.raises(ValueError, match="--lora_r adapts a pretrained model: pass --model_name_or_path"):
        run_script("train_lm", ["--train_file", corpus, "--output_dir", out, "--lora_r", "8", "--max_train_steps",
                                "2", *QUIET])
    if importlib.util.find_spec("peft") is not None:
        with pytest.raises(ValueError, match=r"--lora_target_modules \['fc_inn'\]"):
            lora_run(models, corpus, out, "--lora_r", "8", "--lora_target_modules", "fc_inn")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now fails, as where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'attnzoo\[peft\]'"):
        lora_run(models, corpus, out, "--lora_r", "8")
    assert not out.exists()


# -- retrieval in the transfer data ----------------------------------------------------------------------------
def test_passkey_fraction_mixes_retrieval_sequences_into_the_training_data():
    from attnzoo.tokenization import byte_level_tokenizer
    from attnzoo.training.text_data import TokenBlocks, count_passkey_blocks, with_passkey_blocks

    tokenizer = byte_level_tokenizer()
    text = TokenBlocks(torch.tensor(list(english_text()[:12_800])), 128)  # 100 blocks
    mixed = with_passkey_blocks(text, 0.2, tokenizer, 128, seed=3)
    assert len(mixed) == 125 and count_passkey_blocks(mixed) == 25  # 25 of 125 sequences are retrieval ones
    passkey = [bytes(mixed[i]["input_ids"].tolist()).decode() for i in range(100, 125)]
    assert all("The pass key is" in p and p.rstrip().split()[-1].rstrip(".").isdigit() for p in passkey)
    again = with_passkey_blocks(text, 0.2, tokenizer, 128, seed=3)
    assert all(torch.equal(mixed[i]["input_ids"], again[i]["input_ids"]) for i in range(125))  # from --seed
    assert with_passkey_blocks(text, 0.0, tokenizer, 128, seed=3) is text and count_passkey_blocks(text) == 0
    with pytest.raises(ValueError, match="--passkey_fraction=0.2 with --block_size=32"):
        with_passkey_blocks(TokenBlocks(torch.arange(320) % 256, 32), 0.2, tokenizer, 32, seed=0)


def test_passkey_fraction_is_checked(tmp_path, models, corpus):
    with pytest.raises(ValueError, match="--passkey_fraction=1.0"):
        run_script("transfer_attention", transfer_args(models, corpus, tmp_path / "run", "perf", "performer",
                                                       LEARNED_FAVOR, "--passkey_fraction", "1.0"))
