"""Converters from other libraries' checkpoints to attnzoo models."""
