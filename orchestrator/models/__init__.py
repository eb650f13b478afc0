"""Models: the registry and fetch, GGUF conversion, architectures, random-weight models,
building engines."""
