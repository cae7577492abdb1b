"""The task heads every family shares (causal and masked LM, sequence and image classification, encoder-decoder
generation), over the base models of `base_models.py`."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutput,
    CausalLMOutputWithPast,
    ImageClassifierOutput,
    MaskedLMOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
)

from attnzoo.modeling.backbone import ZooTransformer
from attnzoo.modeling.base_models import (
    ZooPreTrainedModel,
    ZooSeq2SeqEncoder,
    as_output,
    embed_token_ids,
    family_base_model,
)
from attnzoo.modeling.cache import ZooCache, new_encoder_decoder_cache
from attnzoo.modeling.loss import IGNORE_INDEX, causal_lm_loss, token_cross_entropy, upcast
from attnzoo.transformers_compat import output_cache, take_cache, with_cache


def _wants_logits(model, labels, skip_logits) -> bool:
    """Whether to materialise the [batch, length, vocab] logits. `skip_logits` (transformers' name for it) decides
    when given; by default they are skipped only where the chunked loss exists to avoid them: a training forward with
    labels and `loss_chunk_size` set. Evaluation (e.g. the Trainer's `compute_metrics`) always gets logits."""
    if skip_logits is not None:
        return not skip_logits
    return labels is None or not model.config.loss_chunk_size or not model.training


def lm_logits_and_loss(model, hidden, labels, *, causal: bool, skip_logits=None, num_items_in_batch=None,
                       logits_to_keep: int = 0):
    """(logits or None, loss or None) of a language-model head `model.lm_head` over `hidden`, shared by the causal,
    masked and encoder-decoder heads. A loss reuses logits already computed for all positions; otherwise it runs the
    head itself, in chunks of `loss_chunk_size` (the chunked loss never holds every position's logits)."""
    logits = loss = None
    if _wants_logits(model, labels, skip_logits):
        logits = model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
    if labels is not None:
        if tuple(labels.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"labels has shape {tuple(labels.shape)}; expected {tuple(hidden.shape[:2])}, one label "
                             "per token (-100 where no loss is wanted), like the input ids.")
        loss_fn = causal_lm_loss if causal else token_cross_entropy
        if logits is not None and not logits_to_keep:
            loss = loss_fn(logits, labels, nn.Identity(), 0, num_items_in_batch)
        else:
            loss = loss_fn(hidden, labels, model.lm_head, model.config.loss_chunk_size, num_items_in_batch)
    return logits, loss


def _as_decoder(config):
    if config.is_decoder:
        return config
    config = copy.deepcopy(config)
    config.is_decoder = True
    return config


class ZooForCausalLM(ZooPreTrainedModel, GenerationMixin):
    """Decoder-only language model; `generate()` decodes incrementally through the layers' caches."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        config = _as_decoder(config)
        super().__init__(config)
        self.model = family_base_model(type(self))(config)
        self.lm_head = nn.Linear(config.stack_output_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def new_decoding_cache(self, max_cache_len: int | None = None):
        """An empty cache for incremental decoding: each layer's attention picks its slot; with `max_cache_len`,
        static slots for up to that many positions (prompt plus new tokens), for compiled or graph-captured
        decoding (docs/compile.md)."""
        return ZooCache.for_transformer(self.model.transformer, max_cache_len)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                cache=None, labels=None, use_cache=None, output_hidden_states=None, return_dict=None,
                logits_to_keep: int = 0, num_items_in_batch=None, skip_logits: bool | None = None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, cache=take_cache(cache, kwargs), use_cache=use_cache,
                         output_hidden_states=output_hidden_states, return_dict=True)
        logits, loss = lm_logits_and_loss(self, out.last_hidden_state, labels, causal=True, skip_logits=skip_logits,
                                          num_items_in_batch=num_items_in_batch, logits_to_keep=logits_to_keep)
        result = with_cache(CausalLMOutputWithPast, output_cache(out), loss=loss, logits=logits,
                            hidden_states=out.hidden_states)
        return as_output(result, return_dict, self.config)


class ZooForMaskedLM(ZooPreTrainedModel):
    """Bidirectional encoder with a masked-token prediction head (tied to the input embeddings)."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        if config.is_decoder:
            raise ValueError("ZooForMaskedLM needs a bidirectional encoder; set is_decoder=False.")
        self.model = family_base_model(type(self))(config)
        self.lm_head = MaskedLMHead(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, value):
        self.lm_head.decoder = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, return_dict=None, num_items_in_batch=None, skip_logits: bool | None = None,
                **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states, return_dict=True)
        logits, loss = lm_logits_and_loss(self, out.last_hidden_state, labels, causal=False, skip_logits=skip_logits,
                                          num_items_in_batch=num_items_in_batch)
        return as_output(MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states), return_dict,
                       self.config)


class MaskedLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.stack_output_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden):
        return self.decoder(self.norm(self.act(self.dense(hidden))))


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, how: str) -> torch.Tensor:
    """Summarise [batch, length, hidden] into [batch, hidden]: masked mean, first token, or last real token."""
    if how == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        return hidden.mean(dim=1) if how == "mean" else hidden[:, -1]
    attention_mask = attention_mask != 0  # any non-zero value marks a real token, as in the backbone
    mask = attention_mask.to(hidden.dtype)
    if how == "mean":
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (positions * attention_mask.long()).argmax(dim=1)  # the last real token, for left or right padding
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def classification_loss(config, logits, labels):
    """Regression (MSE), single-label (cross-entropy) or multi-label (BCE), as transformers' heads choose."""
    if labels.shape[0] != logits.shape[0] or labels.dim() > 2:
        raise ValueError(f"labels has shape {tuple(labels.shape)} for a batch of {logits.shape[0]}; expected "
                         f"({logits.shape[0]},) class ids or values, or ({logits.shape[0]}, {logits.shape[-1]}) for "
                         "multi-label targets.")
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    logits = upcast(logits)
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1))
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits, labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


class ClassifierHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        rate = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(rate)
        self.classifier = nn.Linear(config.stack_output_size, config.num_labels)

    def forward(self, pooled):
        return self.classifier(self.dropout(pooled))


class ZooForSequenceClassification(ZooPreTrainedModel):
    """Sequence classification or regression from the pooled sequence (`config.pooling`)."""

    # The loss is a mean over examples: the Trainer then divides by the accumulation steps itself.
    accepts_loss_kwargs = False

    def __init__(self, config):
        super().__init__(config)
        self.model = family_base_model(type(self))(config)
        self.head = ClassifierHead(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=False, output_hidden_states=output_hidden_states,
                         return_dict=True)
        logits = self.head(pool(out.last_hidden_state, attention_mask, self.config.pooling))
        loss = classification_loss(self.config, logits, labels) if labels is not None else None
        return as_output(SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states),
                       return_dict, self.config)


class ZooForImageClassification(ZooPreTrainedModel):
    main_input_name = "pixel_values"
    # The loss is a mean over examples (soft Mixup targets included): the Trainer divides by accumulation steps.
    accepts_loss_kwargs = False

    def __init__(self, config):
        if config.modality != "image":
            config = copy.deepcopy(config)
            config.modality = "image"
        super().__init__(config)
        self.model = family_base_model(type(self))(config)
        self.head = ClassifierHead(config)
        self.post_init()

    def forward(self, pixel_values=None, labels=None, output_hidden_states=None, return_dict=None, **kwargs):
        out = self.model(pixel_values=pixel_values, output_hidden_states=output_hidden_states, return_dict=True)
        logits = self.head(pool(out.last_hidden_state, None, self.config.pooling))
        loss = None
        if labels is not None:  # soft targets (Mixup/CutMix) are [batch, num_labels] floats
            if labels.dim() == 2 and labels.is_floating_point() and labels.shape[-1] == logits.shape[-1] > 1:
                loss = torch.sum(-labels * upcast(logits).log_softmax(-1), dim=-1).mean()
            else:
                loss = classification_loss(self.config, logits, labels)
        return as_output(ImageClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states),
                       return_dict, self.config)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, start_token_id: int) -> torch.Tensor:
    shifted = labels.new_empty(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = start_token_id
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad_token_id)


class ZooForConditionalGeneration(ZooPreTrainedModel, GenerationMixin):
    """Encoder-decoder (translation). The encoder uses `attn_layers`, the decoder `decoder_attn_layers` for its
    causal self-attention and exact cross-attention to the encoder output."""

    _tied_weights_keys = {"lm_head.weight": "encoder.embed_tokens.weight"}

    def __init__(self, config):
        if not config.is_encoder_decoder:
            config = copy.deepcopy(config)
            config.is_encoder_decoder = True
        if config.decoder_start_token_id is None or config.pad_token_id is None:
            raise ValueError("encoder-decoder models need decoder_start_token_id and pad_token_id in the config.")
        super().__init__(config)
        self.encoder = ZooSeq2SeqEncoder(config)
        self.decoder = ZooTransformer(config, causal=True, decoder_side=True, cross_attention=True)
        self.lm_head = nn.Linear(config.stack_output_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_encoder(self, modality=None):
        return self.encoder

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value):
        self.encoder.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def new_decoding_cache(self, max_cache_len: int | None = None):
        """An empty cache for incremental decoding (static decoder slots with `max_cache_len`, as for decoders)."""
        return new_encoder_decoder_cache(self.decoder, max_cache_len)

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, cache=None, labels=None, use_cache=None, output_hidden_states=None,
                return_dict=None, num_items_in_batch=None, skip_logits: bool | None = None, **kwargs):
        cache = take_cache(cache, kwargs)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           output_hidden_states=output_hidden_states)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("pass decoder_input_ids or labels.")
            decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id,
                                                   self.config.decoder_start_token_id)
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = new_encoder_decoder_cache(self.decoder)
        hidden, decoder_hidden = self.decoder(
            embed_token_ids(self.encoder.embed_tokens, decoder_input_ids, "decoder_input_ids"),
            attention_mask=decoder_attention_mask,
            cache=cache if use_cache else None,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            output_hidden_states=bool(output_hidden_states),
        )
        logits, loss = lm_logits_and_loss(self, hidden, labels, causal=False, skip_logits=skip_logits,
                                          num_items_in_batch=num_items_in_batch)
        out = with_cache(Seq2SeqLMOutput, cache if use_cache else None, loss=loss, logits=logits,
                         decoder_hidden_states=decoder_hidden,
                         encoder_last_hidden_state=encoder_outputs.last_hidden_state,
                         encoder_hidden_states=encoder_outputs.hidden_states)
        return as_output(out, return_dict, self.config)
