"""Measuring: benchmarks, sweeps, tuning, timelines, the simulator, the runtime bench."""
