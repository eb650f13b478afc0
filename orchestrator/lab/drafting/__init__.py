"""Draft models: distillation, training loop and evaluation of token sources."""
