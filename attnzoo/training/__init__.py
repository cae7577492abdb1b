"""What the training scripts share: recipes and arguments, data, the training loop's checkpointing, metrics."""
