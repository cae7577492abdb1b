"""Centres (`lsh_centre_keys`) and learned buckets (`lsh_key_centroids`) for the keys of a converted model's LSH far
parts, from a calibration text: no training.

Angular LSH puts a vector in a bucket by its direction alone ("Reformer: The Efficient Transformer", arXiv
2001.04451, §2), so a query finds the keys whose directions are near its own. A pretrained model's keys are not spread
over directions: within a head they share a large common component that its queries do not share, so hashed as they
are, nearly every key falls in a few buckets and the queries in others. On SmolLM2-135M (LSH in the key-value heads
`benchmarks/pretrained_long_context.py`'s `lsh_heads` keeps a far part in) the question's bucket held almost none of
the far keys in any round, and not the pass key, in heads whose exact scores rank the pass key first.

Subtracting each head's mean key c before hashing changes no score (every retrieved key is scored with the exact
q·k, and q·(k - c) = q·k - q·c is q·k less a constant per query, which a softmax ignores) and spreads the keys over
the buckets by what sets them apart. The centre is a buffer of the layer (`lsh_key_centre`, one per key-value head),
fixed once calibrated, so a key's buckets depend on nothing after it and decoding hashes as the full forward does.

    model = AutoModelForCausalLM.from_pretrained(converted)  # its config: lsh_shared_qk=False, lsh_centre_keys=True
    centre_lsh_keys(model, ids)  # ids [batch, length]: a calibration text's tokens
    model.save_pretrained(dst)

Learned buckets (`lsh_key_centroids`; docs/lsh_attention.md, "Learned buckets") go one step further: k-means
centroids of the same centred keys, a key hashed to its nearest and a query probing the ones it scores highest.
After the centres, `fit_lsh_key_centroids(model, ids)` sets them (a buffer `lsh_key_centroids` per layer).
"""

from __future__ import annotations

import torch


def centred_lsh_parts(model) -> dict[int, object]:
    """{layer index: its LSH far part} for every layer of `model` whose LSH far part centres its keys."""
    from attnzoo.modeling.attention.lsh_window import LSHFarPart

    return {m.layer_idx: m.far for m in model.modules()
            if isinstance(getattr(m, "far", None), LSHFarPart) and m.far.centre_keys}


def check_calibration_ids(input_ids: torch.Tensor) -> None:
    """ValueError unless `input_ids` is [batch, length] with length > 0."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids of shape {list(input_ids.shape)}; pass [batch, length] token ids of a "
                         "calibration text, length > 0.")


@torch.no_grad()
def centre_lsh_keys(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) \
        -> dict[int, torch.Tensor]:
    """Set every centring LSH far part's `lsh_key_centre` to the mean of the keys it hashes in one forward over
    `input_ids` [batch, length] (real tokens only, by `attention_mask`), the centres at zero during that forward (so
    the result does not depend on earlier centres); returns {layer index: centre [kv_heads, head_dim]}. ValueError
    when the model has no such far part."""
    parts = centred_lsh_parts(model)
    if not parts:
        raise ValueError("the model has no LSH far part that centres its keys: centre_lsh_keys needs lsh_window (or "
                         "causal lsh) layers with lsh_shared_qk=False and lsh_centre_keys=True in its config; "
                         "convert or load it with those settings.")
    check_calibration_ids(input_ids)
    was_training = model.training
    previous = {index: part.layer.lsh_key_centre.clone() for index, part in parts.items()}
    model.eval()
    for part in parts.values():
        part.layer.lsh_key_centre.zero_()
        part.key_record = []
    centres = previous  # kept if the forward fails (a bad mask, too little memory): nothing is lost
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        centres = {}
        for index, part in parts.items():
            sums = torch.stack([total for total, _ in part.key_record]).sum(0)
            count = torch.stack([n for _, n in part.key_record]).sum()
            centres[index] = (sums / count).to(part.layer.lsh_key_centre.dtype)
    finally:
        for index, part in parts.items():
            part.key_record = None
            part.layer.lsh_key_centre.copy_(centres[index])
        model.train(was_training)
    return centres


#: Lloyd's iterations `fit_lsh_key_centroids` runs by default
CENTROID_ITERATIONS = 20


def kmeans(points: torch.Tensor, count: int, iterations: int = CENTROID_ITERATIONS) -> torch.Tensor:
    """[count, d] centroids of points [n, d] (n >= count) after `iterations` of Lloyd's algorithm, started from
    evenly spaced points (deterministic: no random draw); a centroid left without points keeps its place."""
    centroids = points[torch.linspace(0, len(points) - 1, count).round().long()].clone()
    for _ in range(iterations):
        nearest = (2 * points @ centroids.T - (centroids * centroids).sum(-1)).argmax(-1)
        sums = torch.zeros_like(centroids).index_add_(0, nearest, points)
        counts = torch.bincount(nearest, minlength=count)[:, None]
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
    return centroids


def centroid_lsh_parts(model) -> dict[int, object]:
    """{layer index: its LSH far part} for every layer of `model` whose LSH far part buckets by learned centroids."""
    return {index: part for index, part in centred_lsh_parts(model).items() if part.key_centroids}


@torch.no_grad()
def fit_lsh_key_centroids(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          iterations: int = CENTROID_ITERATIONS) -> dict[int, torch.Tensor]:
    """Set every learned-bucket LSH far part's `lsh_key_centroids` to k-means centroids (`lsh_num_buckets` per
    key-value head, `iterations` of Lloyd's from evenly spaced keys) of the keys it hashes in one forward over
    `input_ids` [batch, length] (real tokens only), each minus its head's centre: set the centres first
    (`centre_lsh_keys`). The centroids are zero during that forward (every key in one bucket), so the result does not
    depend on earlier ones. Returns {layer index: centroids [kv_heads, buckets, head_dim]}. ValueError when the
    model has no such far part, or the text has fewer real tokens than buckets."""
    parts = centroid_lsh_parts(model)
    if not parts:
        raise ValueError("the model has no LSH far part with learned buckets: fit_lsh_key_centroids needs lsh_window "
                         "layers with lsh_shared_qk=False, lsh_centre_keys=True and lsh_key_centroids=True in its "
                         "config; convert or load it with those settings.")
    check_calibration_ids(input_ids)
    real = input_ids.numel() if attention_mask is None else int(attention_mask.sum())
    count = next(iter(parts.values())).layer.lsh_key_centroids.shape[1]
    if real < count:
        raise ValueError(f"input_ids hold {real} real tokens, fewer than the {count} centroids (lsh_num_buckets) "
                         "k-means fits: pass a longer calibration text.")
    if iterations < 0:
        raise ValueError(f"iterations={iterations}: give 0 or more Lloyd's iterations.")
    was_training = model.training
    previous = {index: part.layer.lsh_key_centroids.clone() for index, part in parts.items()}
    model.eval()
    for part in parts.values():
        part.layer.lsh_key_centroids.zero_()  # so a later layer's keys do not depend on earlier centroids
        part.key_capture = []
    fitted = previous  # kept if the forward fails: nothing is lost
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        fitted = {}
        for index, part in parts.items():
            keys = torch.cat(part.key_capture, dim=1).float()  # [kv_heads, real tokens, d]
            fitted[index] = torch.stack([kmeans(head, count, iterations) for head in keys])
    finally:
        for index, part in parts.items():
            part.key_capture = None
            part.layer.lsh_key_centroids.copy_(fitted[index].to(part.layer.lsh_key_centroids.dtype))
        model.train(was_training)
    return fitted
