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
settings = dict(attn_layers=["elu_plus_one_window", "window"], is_decoder=True, window_size=4, num_sink_tokens=2,
                vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, position_embedding_type="rotary", hidden_dropout_prob=0.0, pad_token_id=0)
model = ZooWindowForCausalLM(ZooWindowConfig(**settings))
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
def decoding_gap(model):
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        steps = [out.logits]
        for t in range(6, 24):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=output_cache(out), use_cache=True)
            steps.append(out.logits)
    return ((torch.cat(steps, 1) - full) * mask.bool()[..., None]).abs().max().item()

model.eval()
gap = decoding_gap(model)
assert gap < 1e-5, gap

# kept in one of the two key-value heads (far_kv_heads): built for that head's two query heads, nothing else to write
heads = ZooWindowForCausalLM(ZooWindowConfig(**settings, far_kv_heads=[[1], None])).eval()
assert heads.model.transformer.blocks[0].attn.far_weight.shape == (2,)
gap = decoding_gap(heads)
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


SAVE = """
import json, sys, torch
sys.path.insert(0, {folder!r})
import elu_far_part
from attnzoo import ZooWindowConfig, ZooWindowForCausalLM

torch.manual_seed(0)
config = ZooWindowConfig(attn_layers=["elu_plus_one_window", "window"], is_decoder=True, window_size=4,
                         num_sink_tokens=2, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, hidden_dropout_prob=0.0)
model = ZooWindowForCausalLM(config).eval()
with torch.no_grad():
    model.model.transformer.blocks[0].attn.far_weight.normal_()  # a trained far part: its own weights matter
    logits = model(torch.arange(1, 17)[None]).logits
model.save_pretrained({saved!r})
print(json.dumps({{"logits": logits.flatten().tolist()}}))
"""

LOAD_WHERE_ATTNZOO_IS_IMPORTED = """
import json, sys, torch
import attnzoo  # installed and imported; the user's module is not
from transformers import AutoModelForCausalLM
from attnzoo.modeling.attention import FAR_PART_REGISTRY

refused = []
for load in (lambda: AutoModelForCausalLM.from_pretrained({saved!r}),
             lambda: attnzoo.ZooWindowForCausalLM.from_pretrained({saved!r})):
    try:
        load()
    except ValueError as error:
        refused.append(str(error))
model = AutoModelForCausalLM.from_pretrained({saved!r}, trust_remote_code=True).eval()
layer = model.model.transformer.blocks[0].attn
with torch.no_grad():
    logits = model(torch.arange(1, 17)[None]).logits
model.save_pretrained({resaved!r})
sys.path.insert(0, {mine!r})
import elu_far_part  # the user's own module, imported later, takes the name over from the checkpoint's copy
print(json.dumps({{"refused": refused, "module": type(layer).__module__, "far": type(layer.far).__name__,
                   "logits": logits.flatten().tolist(),
                   "taken_over": FAR_PART_REGISTRY["elu_plus_one"] is elu_far_part.EluPlusOneFarPart}}))
"""


def test_the_checkpoint_loads_its_own_far_part_where_attnzoo_is_imported_given_trust_remote_code(tmp_path):
    """Where attnzoo is imported, transformers builds the checkpoint from attnzoo's installed classes (a registered
    local class wins over remote code, trust_remote_code or not), whose registry lacks the user's far part: without
    trust_remote_code the error names the module to import and the flag; with it, the checkpoint's copy of the
    module runs against the installed attnzoo, the logits are the original's, and a new save carries the same
    files."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "elu_far_part.py").write_text(doc_blocks()["elu_far_part.py"], encoding="utf-8")
    saved, resaved = tmp_path / "elu-window", tmp_path / "elu-window-again"
    here = json.loads(run(SAVE.format(folder=str(mine), saved=str(saved)), tmp_path).splitlines()[-1])
    there = json.loads(run(LOAD_WHERE_ATTNZOO_IS_IMPORTED.format(saved=str(saved), resaved=str(resaved),
                                                                 mine=str(mine)), tmp_path).splitlines()[-1])
    hint = (f"The checkpoint {saved} carries it in user_elu_far_part.py, its copy of the module elu_far_part; with "
            "attnzoo imported, transformers builds the model from attnzoo's installed classes, not the checkpoint's "
            "code. Import elu_far_part before loading, or pass trust_remote_code=True to run the checkpoint's copy.")
    assert len(there["refused"]) == 2, there["refused"]
    for message in there["refused"]:
        assert message.startswith("attn_layers=['elu_plus_one_window', 'window'] is invalid: unknown attention "
                                  "'elu_plus_one_window'; known kinds: [") and message.endswith(hint), message
    assert there["module"] == "user_elu_far_part" and there["far"] == "EluPlusOneFarPart"
    assert there["logits"] == here["logits"]
    assert there["taken_over"]
    files = sorted(path.name for path in saved.glob("*.py"))
    assert sorted(path.name for path in resaved.glob("*.py")) == files and "user_elu_far_part.py" in files
    for name in files:
        assert (resaved / name).read_bytes() == (saved / name).read_bytes(), name
