"""The scheduling core: every rule that decides what a pipeline step holds.

Pure Python and torch-free, so the in-process engine, the distributed runtime's
processes and the lab all import the same rules: the prefill layout, the KV budget,
the width policy, the verdict rule and the step records they are priced from.
"""
