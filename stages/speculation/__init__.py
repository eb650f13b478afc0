"""SpecPipe's schedule: the speculative tree, the step core, token sources, the engine."""
