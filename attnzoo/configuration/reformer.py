"""The Reformer family ("Reformer: The Efficient Transformer", Kitaev, Kaiser and Levskaya, ICLR 2020, arXiv
2001.04451): LSH and local attention in a reversible stack with axial positions and chunked feed-forward layers."""

from __future__ import annotations

from attnzoo.configuration.base import ZooConfig
from attnzoo.configuration.window import ZooWindowSettings
from attnzoo.validation import check_choice, check_int, check_positive_ints, check_probability, fail

LSH_ATTEND_TO = ("chunk", "bucket")
#: what a learned bucket scores with `lsh_member_mean_block` (the `lsh_member_score` docstring says how)
LSH_MEMBER_SCORES = ("mean", "log_mass")


class ZooReformerSettings(ZooConfig):
    r"""
    The settings of the Reformer's attentions ("lsh", "local", and LSH as the far part of "lsh_window"). How LSH
    attention computes what these settings describe, with its derivations, is in docs/lsh_attention.md.

    Args:
        attention_head_size: width of one attention head; `None` means `hidden_size // num_attention_heads`. A
            different value (heads x size != hidden_size) is allowed, as in transformers' `ReformerConfig`.
        lsh_chunk_length: length of the chunks the hash-sorted sequence is cut into (§2, "chunked attention").
        lsh_num_chunks_before / lsh_num_chunks_after: how far a query's window reaches back / ahead in the sorted
            order, in chunks. The paper, trax and transformers look one chunk back and none ahead (the default); a
            chunk ahead widens bidirectional layers' windows (causal layers never look ahead).
        lsh_num_buckets: hash buckets per round: an even int, a list of even factors (factorised hashing, their
            product is the bucket count), or `None` for 2 * max_position_embeddings / lsh_chunk_length (the paper's
            2 * length / chunk at the training length, which the training scripts make max_position_embeddings),
            factorised into two factors above 128 buckets so the rotation matrix stays small. The count is fixed
            per model, so a position hashes the same whatever the sequence's length; set it explicitly when you
            train on sequences much shorter than max_position_embeddings.
        lsh_num_hashes / lsh_num_hashes_eval: hash rounds in training / evaluation (`None`: same as training).
        lsh_hash_seed: seed of the hash rotations in training and evaluation; `None` draws new ones from the global
            RNG every training forward and uses `eval_seed` in evaluation.
        lsh_full_attention_threshold: sequences of at most this many tokens get full shared-QK attention instead of
            hashing (`None`: lsh_chunk_length). In causal layers the first this-many positions of every sequence
            attend fully (to at most this many keys), so a position's attention does not depend on the length.
            Shared-QK "lsh" layers only: with `lsh_shared_qk=False` a query always attends to its own key, and
            the threshold must be 0 or None.
        lsh_attend_to: which keys a query sees in each round. "bucket" (default): only keys of its own bucket (§2,
            Eq. 3), at most `lsh_num_chunks_before * lsh_chunk_length` sorted positions before it (and
            `lsh_num_chunks_after * lsh_chunk_length` after it in bidirectional layers): a window that slides with
            the query instead of the chunk grid. A causal query's keys then depend on earlier tokens only, and
            cached decoding computes exactly the same attention. "chunk": every key of its sorted chunk and of the
            neighbouring chunks, across buckets (trax's and transformers' choice); there a causal query's window
            also depends on how many later tokens hash to lower buckets (no later value is attended, but outputs
            are not strictly causal), and decoding sees only the same-bucket part of it.
        lsh_duplicate_correction: make multi-round attention one softmax over the union of the rounds' keys, a key
            attended in several rounds counted once (Appendix A).
        lsh_shared_qk: True (the Reformer's, §2): one projection gives queries and keys (k = q / |q|), scores
            q·k without scaling, a query's own key penalised. False ("lsh_window" layers and causal "lsh" layers):
            separate query and key projections, as a pretrained model has them (a Llama converts keeping its
            k_proj); queries and keys are hashed apart with the same rotations, each key retrieved is scored with
            the exact q·k / √d, and "bucket" is the only `lsh_attend_to` (docs/lsh_attention.md, "Separate
            queries and keys"). An "lsh" layer then attends to its own key and, in every round, to the most recent
            earlier keys of its bucket (`lsh_window` with a window of one token).
        lsh_centre_keys: with separate queries and keys, hash each key minus a per-head centre (the layer's buffer
            `lsh_key_centre`, zero until set, e.g. to the mean key of a calibration text by
            `attnzoo.convert.lsh_key_centres.centre_lsh_keys`). Scores are unchanged (q·(k - c) differs from q·k by
            a constant per query, and every retrieved key is scored with the exact q·k); what changes is which keys
            share a query's bucket. A pretrained model's keys share a large common direction that its queries do
            not, so uncentred angular hashing puts the keys in a few buckets and the queries in others
            (docs/lsh_attention.md, "Centred keys").
        lsh_key_centroids: with centred keys (`lsh_centre_keys`), bucket by content learned from a calibration text
            instead of by random rotations: `lsh_num_buckets` centroids per key-value head (the layer's buffer
            `lsh_key_centroids`, zero until fitted, e.g. by k-means on a calibration text's centred keys with
            `attnzoo.convert.lsh_key_centres.fit_lsh_key_centroids`); a key's bucket is its nearest centroid, the
            same in every round, and a query's bucket in round r is the centroid it scores r-th highest (q·c), so
            `lsh_num_hashes` is the number of buckets a query probes. Scores are unchanged; what changes is which
            keys are candidates (docs/lsh_attention.md, "Learned buckets").
        lsh_member_mean_block: with learned buckets (`lsh_key_centroids`), rank the buckets a query probes by the
            mean key of their members instead of by their centroids: a bucket's score is q·(μ + Σ k) / (1 + n) over
            the n far keys it holds (centred, past the sinks), its centroid μ counting as one member, so an empty
            bucket scores as its centroid. The sums are taken once per block of this many tokens: a query at
            position i ranks by the far keys at positions up to ⌊i / P⌋·P - window_size, which decoding keeps as a
            sum and a count per bucket (docs/lsh_attention.md, "Probing by the members' mean"). None: by the
            centroids.
        lsh_member_score: with `lsh_member_mean_block`, what a bucket scores: "mean", q·m over its members' mean key
            m = (μ + Σ k) / (1 + n); or "log_mass", q·m / √d + log(1 + n), a lower bound (by Jensen's inequality) on
            the log of the softmax mass its 1 + n members would get, so a bucket ranks by what exact attention would
            give it rather than by its average member (docs/lsh_attention.md, "Ranking by the members' mass").
        lsh_group_rotations: with separate queries and keys, the query heads that share a key-value head hash with
            one set of rotations (their group's), so each key is hashed once per round for its group rather than
            once per query head: a grouped-query model (SmolLM2's 3 query heads a key head) hashes a third as many
            keys and its decoding index is a third the size. Each query head still has its own buckets and
            candidates; what changes is that the group's heads draw no rotations of their own
            (docs/lsh_attention.md, "Grouped rotations").
        lsh_attention_probs_dropout_prob / local_attention_probs_dropout_prob: dropout on the attention
            probabilities (`None`: `attention_probs_dropout_prob`).
        local_chunk_length / local_num_chunks_before / local_num_chunks_after: local attention's chunks and look-back
            (look-ahead for bidirectional layers).
    """

    attention_head_size: int | None = None

    lsh_chunk_length: int = 64
    lsh_num_chunks_before: int = 1
    lsh_num_chunks_after: int = 0
    lsh_num_buckets: int | list[int] | None = None
    lsh_num_hashes: int = 2
    lsh_num_hashes_eval: int | None = None
    lsh_hash_seed: int | None = None
    lsh_full_attention_threshold: int | None = None
    lsh_attend_to: str = "bucket"
    lsh_duplicate_correction: bool = True
    lsh_shared_qk: bool = True
    lsh_centre_keys: bool = False
    lsh_key_centroids: bool = False
    lsh_member_mean_block: int | None = None
    lsh_member_score: str = "mean"
    lsh_group_rotations: bool = False
    lsh_attention_probs_dropout_prob: float | None = None

    local_chunk_length: int = 64
    local_num_chunks_before: int = 1
    local_num_chunks_after: int = 1
    local_attention_probs_dropout_prob: float | None = None

    def __post_init__(self, **kwargs):
        if isinstance(self.lsh_num_buckets, tuple):
            self.lsh_num_buckets = list(self.lsh_num_buckets)
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        # Every Reformer field is checked, also those of an attention kind the current layers do not use, so a
        # saved config is valid whatever attn_layers it is later given.
        super().validate_architecture()
        check_int(self, "attention_head_size", 1, "set a positive integer or None.", optional=True)
        check_positive_ints(self, ("lsh_chunk_length", "lsh_num_hashes", "local_chunk_length"))
        for name in ("lsh_num_chunks_before", "lsh_num_chunks_after", "local_num_chunks_before",
                     "local_num_chunks_after"):
            check_int(self, name, 0, "set a non-negative integer (0 = no neighbouring chunks).")
        check_int(self, "lsh_num_hashes_eval", 1, "set a positive integer, or None to use lsh_num_hashes.",
                  optional=True)
        buckets = self.lsh_num_buckets
        factors = [buckets] if isinstance(buckets, int) and not isinstance(buckets, bool) else buckets
        if buckets is not None and (not isinstance(factors, list | tuple) or not factors or any(
                not isinstance(f, int) or isinstance(f, bool) or f < 2 or f % 2 for f in factors)):
            fail("lsh_num_buckets", buckets, "set an even integer >= 2, a list of such factors, or None for "
                                             "2 * max_position_embeddings / lsh_chunk_length.")
        check_int(self, "lsh_hash_seed", 0, "set a non-negative integer, or None to draw from the global RNG.",
                  optional=True)
        check_int(self, "lsh_full_attention_threshold", 0, "set a non-negative integer (0 = always hash), or None "
                                                           "for lsh_chunk_length.", optional=True)
        check_choice(self, "lsh_attend_to", LSH_ATTEND_TO)
        check_choice(self, "lsh_duplicate_correction", (True, False))
        check_choice(self, "lsh_shared_qk", (True, False))
        if not self.lsh_shared_qk and self.lsh_attend_to != "bucket":
            fail("lsh_attend_to", self.lsh_attend_to, "with lsh_shared_qk=False a query and a key fall in buckets of "
                                                      "their own, so no chunk of a shared sorted order holds both; "
                                                      "set lsh_attend_to='bucket'.")
        check_choice(self, "lsh_centre_keys", (True, False))
        if self.lsh_centre_keys and self.lsh_shared_qk:
            fail("lsh_centre_keys", self.lsh_centre_keys, "shared-QK keys are the normalised queries, hashed as the "
                                                          "queries are; set lsh_shared_qk=False to centre keys apart.")
        check_choice(self, "lsh_key_centroids", (True, False))
        if self.lsh_key_centroids:
            if not self.lsh_centre_keys:
                fail("lsh_key_centroids", self.lsh_key_centroids, "centroids are fitted to centred keys; set "
                                                                  "lsh_centre_keys=True (and lsh_shared_qk=False).")
            if not isinstance(buckets, int) or isinstance(buckets, bool):
                fail("lsh_num_buckets", buckets, "with lsh_key_centroids it is the number of centroids: set one "
                                                 "integer, not factors or None.")
            probes = max(self.lsh_num_hashes, self.lsh_num_hashes_eval or 0)
            if probes > buckets:
                fail("lsh_num_hashes", probes, f"with lsh_key_centroids a query probes that many of the {buckets} "
                                               "buckets; set at most lsh_num_buckets (and lsh_num_hashes_eval).")
        check_int(self, "lsh_member_mean_block", 1, "set a positive number of tokens, or None to rank the buckets "
                                                    "by their centroids.", optional=True)
        if self.lsh_member_mean_block is not None and not self.lsh_key_centroids:
            fail("lsh_member_mean_block", self.lsh_member_mean_block, "the members' mean ranks learned buckets; set "
                                                                      "lsh_key_centroids=True, or None here.")
        check_choice(self, "lsh_member_score", LSH_MEMBER_SCORES)
        if self.lsh_member_score != "mean" and self.lsh_member_mean_block is None:
            fail("lsh_member_score", self.lsh_member_score, "it scores buckets by their members' sums; set "
                                                            "lsh_member_mean_block too, or leave it 'mean'.")
        check_choice(self, "lsh_group_rotations", (True, False))
        if self.lsh_group_rotations and self.lsh_shared_qk:
            fail("lsh_group_rotations", self.lsh_group_rotations, "shared-QK keys are the queries themselves, one per "
                                                                  "query head, hashed with that head's rotations; "
                                                                  "set lsh_shared_qk=False to share rotations within "
                                                                  "a key-value group.")
        check_probability(self, "lsh_attention_probs_dropout_prob", optional=True)
        check_probability(self, "local_attention_probs_dropout_prob", optional=True)

    @property
    def reformer_head_size(self) -> int:
        """The width of one attention head of the LSH and local layers."""
        return self.attention_head_size or self.head_dim


class ZooReformerConfig(ZooReformerSettings, ZooWindowSettings):
    r"""
    Reformer configuration. The defaults are the paper's enwik8 set-up (§5; trax's `reformer_enwik8.gin`:
    alternating local and LSH layers, 2 hash rounds, ReLU feed-forward, axial positions, no attention biases)
    scaled down to hidden size 256 and chunks of 64.

    Args beyond `ZooConfig`: `ZooReformerSettings`' (LSH and local attention), `ZooWindowSettings`' (the window of
    "lsh_window"), and `attn_layers`: "lsh", "local", "lsh_window" (decoders) or "full", per layer.
    """

    model_type = "attnzoo_reformer"

    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    hidden_act: str = "relu"
    max_position_embeddings: int = 65536
    attention_bias: bool = False
    attn_layers: list[str] | tuple[str, ...] = ("local", "lsh")
    reversible: bool = True
    chunk_size_feed_forward: int = 2048
    position_embedding_type: str = "axial"
