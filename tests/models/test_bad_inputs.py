"""Bad input through the public API, for every family: a clear ValueError naming what is wrong and the fix, or a
documented mapping (a non-zero mask value marks a real token), never a raw torch error or a silent broadcast."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from attnzoo.registration import FAMILY_CONFIGS

SIZES = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64, pad_token_id=0)
SMALL = {"reformer": dict(lsh_chunk_length=8, local_chunk_length=8), "performer": dict(num_random_features=16)}


def causal_lm(family):
    torch.manual_seed(0)
    config = AutoConfig.for_model(f"attnzoo_{family}", **SIZES, **SMALL.get(family, {}))
    return AutoModelForCausalLM.from_config(config).eval()


IDS = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("inputs, message", [
    (dict(input_ids=IDS.clone().fill_(50)), r"input_ids holds token ids outside \[0, vocab_size=50\): min 50, max 50"),
    (dict(input_ids=-IDS), r"input_ids holds token ids outside \[0, vocab_size=50\)"),
    (dict(input_ids=IDS.float()), r"input_ids has dtype torch.float32; token ids are integers"),
    (dict(input_ids=IDS[:, :0]), r"input_ids is empty \(shape \(2, 0\)\)"),
    (dict(input_ids=IDS[:0]), r"input_ids is empty \(shape \(0, 12\)\)"),
    (dict(input_ids=IDS[:1], attention_mask=torch.ones(2, 12)), r"attention_mask has 2 rows but the batch has 1"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 1, 12, 12)), r"attention_mask has shape \(2, 1, 12, 12\); "
                                                                   r"attnzoo models take a 2-D"),
    (dict(input_ids=IDS, labels=IDS[:1]), r"labels has shape \(1, 12\); expected \(2, 12\), one label per token"),
])
def test_bad_token_input_says_what_to_change(family, inputs, message):
    model = causal_lm(family)
    with pytest.raises(ValueError, match=message):
        model(**inputs)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_any_non_zero_mask_value_marks_a_real_token(family):
    model = causal_lm(family)
    binary = torch.ones(2, 12, dtype=torch.long)
    binary[1, :4] = 0
    scaled = binary.float() * torch.tensor([0.5, 2.0]).repeat(6)  # 0.5 and 2 wherever the mask is 1
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, attention_mask=scaled).logits,
                                   model(IDS, attention_mask=binary).logits, rtol=0, atol=0)


def test_classification_labels_of_the_wrong_shape_say_what_is_expected():
    torch.manual_seed(0)
    config = AutoConfig.for_model("attnzoo_softmax", **SIZES, num_labels=3)
    model = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match=r"labels has shape \(3,\) for a batch of 2; expected \(2,\) class ids"):
        model(IDS, labels=torch.tensor([0, 1, 2]))


def test_a_size_given_as_a_string_names_the_field():
    with pytest.raises(ValueError, match=r"hidden_size='32' is invalid: set a positive integer"):
        AutoConfig.for_model("attnzoo_reformer", hidden_size="32")
