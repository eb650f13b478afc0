"""Models: the registry and fetch, GGUF conversion, architectures, building engines."""
