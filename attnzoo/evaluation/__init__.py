"""Evaluation of the zoo's models beyond the training scripts' own metrics. `harness` runs EleutherAI's
lm-evaluation-harness (the optional `lm-eval` extra) on a checkpoint and flattens what it reports; `tasks/` holds
task folders for its `--include_path` (held-out quick-start text as a perplexity, a multiple-choice and a generation
task); `passkey` measures long-context recall."""
