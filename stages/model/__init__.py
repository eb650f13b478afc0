"""The model on a device: layers, KV cache, sampling, early exit, checkpoints, tokenizer."""
