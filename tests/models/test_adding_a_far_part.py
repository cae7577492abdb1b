"""docs/adding_an_attention.md, "A far part for the windowed layer", done as the page says: its far part (elu + 1
features with a learned weight per head) in a module of the user's own, registered from outside the package, trains
a step (its own parameter learns), decodes token by token exactly as the full forward computes, generates, saves,
and loads with `trust_remote_code=True` in a process where neither attnzoo nor the user's file is importable, giving
the same logits and tokens."""

import json

from tests.models.test_adding_an_attention import doc_blocks, run

TRAIN_DECODE_SAVE = """
import json, sys, torch
sys.path.insert(0, {folder!r})
import elu_far_part
from attnzoo import ZooWindowConfig, ZooWindowForCausalLM
from attnzoo.transformers_compat import output_cache

torch.manual_seed(0)
config = ZooWindowConfig(attn_layers=["elu_plus_one_window", "window"], is_decoder=True, window_size=4,
                         num_sink_tokens=2, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, position_embedding_type="rotary",
                         hidden_dropout_prob=0.0, pad_token_id=0)
model = ZooWindowForCausalLM(config)
layer = model.model.transformer.blocks[0].attn
assert type(layer).__name__ == "WindowedEluPlusOneAttention" and type(layer.far).__name__ == "EluPlusOneFarPart"
assert [name for name, _ in layer.own_parameters()] == ["far_weight"]

# one training step: the far part's own parameter gets a gradient and moves
ids = torch.randint(1, 40, (2, 24))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
before = layer.far_weight.detach().clone()
model.train()
model(ids, labels=ids).loss.backward()
assert layer.far_weight.grad.abs().min() > 0
optimizer.step()
assert (layer.far_weight - before).abs().min() > 0

# decoding from the ring and the far part's sums equals the full forward, left padding included
model.eval()
mask = torch.ones_like(ids)
ids[1, :3], mask[1, :3] = 0, 0
with torch.no_grad():
    full = model(ids, attention_mask=mask).logits
    out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
    steps = [out.logits]
    for t in range(6, 24):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
        steps.append(out.logits)
real = mask.bool()[..., None]
gap = ((torch.cat(steps, 1) - full) * real).abs().max().item()
assert gap < 1e-5, gap

prompt = torch.arange(1, 13)[None]
cached = model.generate(prompt, max_new_tokens=8, do_sample=False)
uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
assert cached.tolist() == uncached.tolist()
model.save_pretrained({saved!r})
with torch.no_grad():
    logits = model(prompt).logits
print(json.dumps({{"logits": logits.flatten().tolist(), "generated": cached.tolist()}}))
"""

LOAD_WITHOUT_ATTNZOO = """
import json, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({saved!r}, trust_remote_code=True).eval()
layer = model.model.transformer.blocks[0].attn
prompt = torch.arange(1, 13)[None]
with torch.no_grad():
    logits = model(prompt).logits
generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
print(json.dumps({{"module": type(layer).__module__, "far": type(layer.far).__name__,
                   "logits": logits.flatten().tolist(), "generated": generated.tolist()}}))
"""


def test_a_far_part_of_ones_own_trains_decodes_saves_and_loads_where_attnzoo_is_not(tmp_path):
    (tmp_path / "elu_far_part.py").write_text(doc_blocks()["elu_far_part.py"], encoding="utf-8")
    saved = str(tmp_path / "elu-window")
    here = json.loads(run(TRAIN_DECODE_SAVE.format(folder=str(tmp_path), saved=saved), tmp_path).splitlines()[-1])
    assert (tmp_path / "elu-window" / "user_elu_far_part.py").is_file()
    (tmp_path / "elu_far_part.py").unlink()  # the other machine has neither attnzoo nor the user's file
    there = json.loads(run(LOAD_WITHOUT_ATTNZOO.format(saved=saved), tmp_path, block_attnzoo=True).splitlines()[-1])
    assert there["module"].startswith("transformers_modules") and there["far"] == "EluPlusOneFarPart"
    assert there["logits"] == here["logits"]
    assert there["generated"] == here["generated"]
