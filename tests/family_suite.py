"""The test suite every model family runs by subclassing `FamilySuite` (see tests/models/test_family_softmax.py).

A subclass sets `config_class` and `prefix` (the class-name prefix of its model classes) and may override
`config_overrides` (e.g. attention settings), `attention_patterns` (attn_layers to test), `atol` (the
tolerance of float-error comparisons) or `evaluation_randomness` (config values that make evaluation random).
Models are tiny and run on the CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig

import attnzoo  # noqa: F401  (registers the Auto classes)
from attnzoo.modeling.cache import ZooCache
from attnzoo.registration import AUTO_CLASS_BY_HEAD as AUTO
from attnzoo.transformers_compat import CACHE_KW, output_cache
from tests.attention.helpers import named

VOCAB = 61


class FamilySuite:
    config_class = None
    prefix = ""
    config_overrides: dict = {}
    #: attention patterns the suite builds models with (each a value of `attn_layers`)
    attention_patterns: list = [("full",)]
    #: tolerance for comparing two computations that should agree up to float error
    atol = 1e-5

    # -- helpers -------------------------------------------------------------------------------------------
    def model_class(self, head):
        module = importlib.import_module("attnzoo")
        return getattr(module, self.prefix + head)

    def make_config(self, **overrides):
        values = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, image_size=16, patch_size=4, num_channels=3,
                      pad_token_id=0, decoder_start_token_id=1, eos_token_id=None)
        values.update(self.config_overrides)
        values.update(overrides)
        return self.config_class(**values)

    def inputs_for(self, head, batch=2, length=12, seed=0):
        g = torch.Generator().manual_seed(seed)
        if head == "ForImageClassification":
            return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
        ids = torch.randint(2, VOCAB, (batch, length), generator=g)
        if head == "ForConditionalGeneration":
            return {"input_ids": ids, "decoder_input_ids": torch.randint(2, VOCAB, (batch, 7), generator=g)}
        return {"input_ids": ids}

    def labels_for(self, head, inputs, config):
        if head in ("ForCausalLM", "ForMaskedLM"):
            return inputs["input_ids"]
        if head == "ForConditionalGeneration":
            return inputs["decoder_input_ids"]
        if head in ("ForSequenceClassification", "ForImageClassification"):
            batch = next(iter(inputs.values())).shape[0]
            return torch.arange(batch) % config.num_labels
        return None

    def build(self, head, **overrides):
        torch.manual_seed(0)
        config = self.make_config(**overrides)
        return self.model_class(head)(config)

    @staticmethod
    def main_output(out):
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    # -- Hugging Face integration -------------------------------------------------------------------------
    @pytest.mark.parametrize("head", list(AUTO))
    def test_save_load_gives_identical_outputs(self, head, tmp_path):
        model = self.build(head).eval()
        inputs = self.inputs_for(head)
        with torch.no_grad():
            expected = self.main_output(model(**inputs))
        model.save_pretrained(tmp_path)
        assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "pytorch_model.bin").exists()
        loaded = type(model).from_pretrained(tmp_path).eval()
        with torch.no_grad():
            got = self.main_output(loaded(**inputs))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)

    @pytest.mark.parametrize("head", ["ForCausalLM", "ForMaskedLM", "ForSequenceClassification",
                                      "ForImageClassification"])
    def test_a_heads_backbone_saves_and_loads_as_the_family_base_model(self, head, tmp_path):
        """`model.base_model` is the family's own base model (as `LlamaForCausalLM.model` is a `LlamaModel`), so
        extracting the backbone (for embeddings, or another head) saves a checkpoint `AutoModel` loads."""
        from transformers import AutoModel

        model = self.build(head).eval()
        backbone = model.base_model
        assert type(backbone) is self.model_class("Model")
        inputs = self.inputs_for(head)
        with torch.no_grad():
            expected = backbone(**inputs).last_hidden_state
        backbone.save_pretrained(tmp_path)
        loaded = AutoModel.from_pretrained(tmp_path).eval()
        assert type(loaded) is self.model_class("Model")
        with torch.no_grad():
            torch.testing.assert_close(loaded(**inputs).last_hidden_state, expected, rtol=0, atol=0)

    @pytest.mark.parametrize("head", list(AUTO))
    def test_auto_classes_load_saved_folder(self, head, tmp_path):
        model = self.build(head).eval()
        model.save_pretrained(tmp_path)
        config = AutoConfig.from_pretrained(tmp_path)
        assert type(config) is self.config_class
        loaded = AUTO[head].from_pretrained(tmp_path)
        assert type(loaded) is type(model)
        for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
            assert torch.equal(a, b), name

    @pytest.mark.parametrize("values, field", [
        (dict(num_attention_heads=5), "num_attention_heads"),  # does not divide hidden_size
        (dict(position_embedding_type="rotary-ish"), "position_embedding_type"),
        (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
        (dict(chunk_size_feed_forward=-1), "chunk_size_feed_forward"),
        (dict(position_embedding_type="axial", axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16]),
         "axial_pos_shape"),
        (dict(position_embedding_type="axial", axial_pos_shape=[16, 8], axial_pos_embds_dim=[16, 8]),
         "axial_pos_embds_dim"),
        (dict(pooling="max"), "pooling"),
        (dict(patch_size=5), "patch_size"),
    ])
    def test_bad_config_raises_value_error_naming_the_field(self, values, field):
        with pytest.raises(ValueError, match=rf"^{field}=.* is invalid: "):
            self.make_config(**values)

    def test_unknown_attention_names_raise_where_the_blocks_are_built(self):
        # Attention names are checked where the blocks are built (the registry is open to new attentions).
        with pytest.raises(ValueError, match="attn_layers.*no-such-attention"):
            self.model_class("ForCausalLM")(self.make_config(attn_layers=["no-such-attention"]))

    def test_wrong_input_shapes_raise_value_error(self):
        model = self.build("ForCausalLM").eval()
        with pytest.raises(ValueError, match="attention_mask"):
            model(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4))
        if model.config.position_embedding_type in ("learned", "axial"):  # a table ends at max_position_embeddings
            with pytest.raises(ValueError, match="max_position_embeddings"):
                model(torch.ones(1, 129, dtype=torch.long))
        else:  # computed positions (rotary, sinusoidal) have no table to run out of
            assert torch.isfinite(model(torch.ones(1, 129, dtype=torch.long)).logits).all()
        image_model = self.build("ForImageClassification")
        with pytest.raises(ValueError, match="pixel_values"):
            image_model(pixel_values=torch.zeros(1, 3, 8, 8))

    # -- correctness ----------------------------------------------------------------------------------------
    @pytest.mark.parametrize("is_decoder", [False, True])
    def test_padded_batch_equals_each_sequence_alone(self, is_decoder):
        for pattern in self.attention_patterns:
            model = self.build("Model", is_decoder=is_decoder, attn_layers=list(pattern)).eval()
            g = torch.Generator().manual_seed(1)
            lengths = [9, 5]
            sequences = [torch.randint(2, VOCAB, (n,), generator=g) for n in lengths]
            sides = ["right", "left"] if is_decoder else ["right"]
            for side in sides:
                ids = torch.zeros(2, max(lengths), dtype=torch.long)
                mask = torch.zeros(2, max(lengths), dtype=torch.long)
                for row, seq in enumerate(sequences):
                    span = slice(0, len(seq)) if side == "right" else slice(max(lengths) - len(seq), None)
                    ids[row, span], mask[row, span] = seq, 1
                with torch.no_grad():
                    batched = model(ids, attention_mask=mask, use_cache=False).last_hidden_state
                    for row, seq in enumerate(sequences):
                        alone = model(seq[None], use_cache=False).last_hidden_state[0]
                        real = mask[row].bool()
                        torch.testing.assert_close(batched[row][real], alone, atol=self.atol, rtol=1e-4,
                                                   msg=f"{pattern} {side} padding, row {row}")

    def test_causal_outputs_do_not_see_the_future(self):
        for pattern in self.attention_patterns:
            model = self.build("ForCausalLM", attn_layers=list(pattern)).eval()
            ids = self.inputs_for("ForCausalLM", length=16)["input_ids"]
            t = 9
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 7) % (VOCAB - 2) + 2
            with torch.no_grad():
                a, b = model(ids).logits, model(changed).logits
            torch.testing.assert_close(a[:, :t], b[:, :t], atol=self.atol, rtol=0)
            assert not torch.allclose(a[:, t:], b[:, t:]), "changing a token must change later outputs"

    def test_greedy_generate_with_cache_equals_without_and_full_forward(self):
        for pattern in self.attention_patterns:
            model = self.build("ForCausalLM", attn_layers=list(pattern)).eval()
            prompt = self.inputs_for("ForCausalLM", length=10)["input_ids"]
            kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
            cached = model.generate(prompt, use_cache=True, **kwargs)
            uncached = model.generate(prompt, use_cache=False, **kwargs)
            assert torch.equal(cached, uncached), pattern
            with torch.no_grad():
                logits = model(cached[:, :-1], use_cache=False).logits
            assert torch.equal(logits[:, prompt.shape[1] - 1:].argmax(-1), cached[:, prompt.shape[1]:]), pattern

    def test_generation_contract_on_the_installed_transformers(self):
        """What a transformers release can break without an error (its 5.24 renamed the cache from `past_key_values`
        to `cache`; a model that missed the rename decoded every step from the new token alone, and for Performer and
        LARA the greedy tokens still came out right): per-step logits with and without the cache, beam search, a
        continuation from a cache the user passes under the installed name, and the cache returned under it."""
        model = self.build("ForCausalLM").eval()
        prompt = self.inputs_for("ForCausalLM", length=9)["input_ids"]
        kwargs = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        cached = model.generate(prompt, max_new_tokens=8, use_cache=True, **kwargs)
        uncached = model.generate(prompt, max_new_tokens=8, use_cache=False, **kwargs)
        torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits), atol=1e-5, rtol=1e-5)
        cache = output_cache(cached)
        assert isinstance(cache, ZooCache) and cache.get_seq_length() == prompt.shape[1] + 7
        # continue from the returned cache, passed under the name generate() takes on this transformers
        first = model.generate(prompt, max_new_tokens=4, **kwargs)
        resumed = model.generate(first.sequences, max_new_tokens=4, **{CACHE_KW: output_cache(first)}, **kwargs)
        assert torch.equal(resumed.sequences, cached.sequences)
        beams = dict(num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, use_cache=True, **beams), model.generate(prompt, use_cache=False,
                                                                                           **beams))

    def test_left_padded_generation_equals_each_prompt_alone(self):
        model = self.build("ForCausalLM").eval()
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(2, VOCAB, (n,), generator=g) for n in (8, 5)]
        ids = torch.zeros(2, 8, dtype=torch.long)
        mask = torch.zeros(2, 8, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, 8 - len(p):], mask[row, 8 - len(p):] = p, 1
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        batched = model.generate(ids, attention_mask=mask, **kwargs)[:, 8:]
        for row, p in enumerate(prompts):
            alone = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
            assert torch.equal(batched[row], alone[0, len(p):]), row

    def test_encoder_decoder_generate_with_cache_equals_without(self):
        model = self.build("ForConditionalGeneration").eval()
        source = self.inputs_for("ForCausalLM", length=9)["input_ids"]
        mask = torch.ones_like(source)
        mask[1, 6:] = 0
        kwargs = dict(max_new_tokens=7, do_sample=False)
        cached = model.generate(source, attention_mask=mask, use_cache=True, **kwargs)
        uncached = model.generate(source, attention_mask=mask, use_cache=False, **kwargs)
        assert torch.equal(cached, uncached)
        beams = model.generate(source, attention_mask=mask, num_beams=3, **kwargs)
        assert beams.shape[0] == 2
        with torch.no_grad():  # teacher-forced forward reproduces the greedy choices
            logits = model(input_ids=source, attention_mask=mask, decoder_input_ids=cached[:, :-1]).logits
        assert torch.equal(logits.argmax(-1), cached[:, 1:])

    @pytest.mark.parametrize("head", ["ForCausalLM", "ForConditionalGeneration", "ForSequenceClassification"])
    def test_reversible_backward_equals_plain_autograd(self, head):
        torch.manual_seed(0)
        config = self.make_config(reversible=True, hidden_dropout_prob=0.1, drop_path_rate=0.2)
        model = self.model_class(head)(config).double().train()
        inputs = self.inputs_for(head)
        labels = self.labels_for(head, inputs, config)
        results = []
        for use_reversible_backward in (True, False):
            for module in model.modules():
                if hasattr(module, "use_reversible_backward"):
                    module.use_reversible_backward = use_reversible_backward
            model.zero_grad()
            torch.manual_seed(123)  # the same dropout masks in both runs
            loss = model(**inputs, labels=labels).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}))
        (loss_rev, grads_rev), (loss_ref, grads_ref) = results
        torch.testing.assert_close(loss_rev, loss_ref, rtol=0, atol=1e-12)
        assert grads_rev.keys() == grads_ref.keys()
        for name in grads_ref:
            torch.testing.assert_close(grads_rev[name], grads_ref[name], rtol=1e-7, atol=1e-10, msg=named(name))

    @pytest.mark.parametrize("head", [h for h in AUTO if h != "Model"])
    @pytest.mark.parametrize("reversible", [False, True])
    def test_every_parameter_gets_a_gradient(self, head, reversible):
        pooling = "cls" if head == "ForImageClassification" else "mean"
        model = self.build(head, reversible=reversible, pooling=pooling).train()
        inputs = self.inputs_for(head)
        model(**inputs, labels=self.labels_for(head, inputs, model.config)).loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, missing

    @pytest.mark.parametrize("head", list(AUTO))
    def test_bf16_forward_is_finite(self, head):
        model = self.build(head).to(torch.bfloat16).eval()
        inputs = self.inputs_for(head)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].bfloat16()
        with torch.no_grad():
            out = self.main_output(model(**inputs))
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()

    def test_chunked_feed_forward_and_loss_match_unchunked(self):
        inputs = self.inputs_for("ForCausalLM", length=13)
        results = []
        for chunks in (dict(), dict(chunk_size_feed_forward=4, loss_chunk_size=5)):
            model = self.build("ForCausalLM", **chunks).double().train()
            loss = model(**inputs, labels=inputs["input_ids"]).loss
            loss.backward()
            results.append((loss.detach(), [p.grad for p in model.parameters()]))
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=0)
        for a, b in zip(results[0][1], results[1][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)

    @pytest.mark.parametrize("position_embedding_type", ["learned", "sinusoidal", "axial", "none"])
    def test_position_embedding_kinds_train_on_any_length(self, position_embedding_type):
        model = self.build("ForCausalLM", position_embedding_type=position_embedding_type).train()
        for length in (7, 33):
            ids = torch.randint(2, VOCAB, (2, length))
            loss = model(ids, labels=ids).loss
            loss.backward()
            assert torch.isfinite(loss)

    @pytest.mark.parametrize("pooling", ["mean", "cls"])
    def test_image_classification_hard_and_soft_labels(self, pooling):
        model = self.build("ForImageClassification", pooling=pooling, num_labels=3).train()
        pixels = self.inputs_for("ForImageClassification")["pixel_values"]
        hard = model(pixel_values=pixels, labels=torch.tensor([0, 2])).loss
        soft_targets = torch.tensor([[0.8, 0.1, 0.1], [0.0, 0.5, 0.5]])
        soft = model(pixel_values=pixels, labels=soft_targets).loss
        assert torch.isfinite(hard) and torch.isfinite(soft)

    # -- what Hugging Face users touch first --------------------------------------------------------------------
    #: config values that turn on the family's randomness at evaluation where the suite's overrides turn it off
    evaluation_randomness: dict = {}

    def test_evaluation_is_deterministic_and_cached_decoding_equals_the_full_forward(self):
        model = self.build("ForCausalLM", **self.evaluation_randomness).eval()
        ids = self.inputs_for("ForCausalLM", length=40)["input_ids"]
        with torch.no_grad():
            first, second = model(ids).logits, model(ids).logits
            alone = model(ids[1:]).logits  # an example's output does not depend on its batch
        assert torch.equal(first, second)
        torch.testing.assert_close(alone, first[1:], atol=self.atol, rtol=1e-5)
        out = model.generate(ids[:, :30], max_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            full = model(out.sequences[:, :-1], use_cache=False).logits[:, 29:]
        torch.testing.assert_close(torch.stack(out.logits, 1), full, atol=self.atol, rtol=1e-4)

    @pytest.mark.parametrize("head", list(AUTO))
    def test_builds_on_the_meta_device(self, head):
        with torch.device("meta"):
            model = self.model_class(head)(self.make_config())
        assert {p.device.type for p in model.parameters()} == {"meta"}

    def test_torch_export_of_a_decoder_equals_eager(self):
        model = self.build("ForCausalLM").eval()
        ids = self.inputs_for("ForCausalLM", length=20)["input_ids"]
        program = torch.export.export(model, (ids,))
        with torch.no_grad():
            torch.testing.assert_close(program.module()(ids).logits, model(ids).logits, atol=1e-6, rtol=1e-5)

    def test_assisted_and_prompt_lookup_decoding_equal_greedy_or_refuse_clearly(self):
        model = self.build("ForCausalLM").eval()
        ids = self.inputs_for("ForCausalLM", length=16)["input_ids"][:1]
        ids = torch.cat([ids, ids], dim=1)  # repeats, so prompt lookup finds candidates
        kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        greedy = model.generate(ids, **kwargs)
        for strategy in (dict(prompt_lookup_num_tokens=4), dict(assistant_model=model)):
            if model._is_stateful:  # a recurrent state cannot be rolled back to a rejected candidate
                with pytest.raises(ValueError, match="stateful"):
                    model.generate(ids, **strategy, **kwargs)
            else:
                assert torch.equal(model.generate(ids, **strategy, **kwargs), greedy), strategy

    def test_hidden_states_and_return_dict_follow_transformers(self):
        model = self.build("ForCausalLM").eval()
        ids = self.inputs_for("ForCausalLM")["input_ids"]
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            final = model.model(ids).last_hidden_state
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        torch.testing.assert_close(out.hidden_states[-1], final, rtol=0, atol=0)  # normalised, as GPT-2's
        model.config.return_dict = False
        with torch.no_grad():
            as_tuple = model(ids)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.logits)
