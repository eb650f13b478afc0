"""The lab: benchmarks, sweeps, the simulator, tuning, timelines, draft training and eval.

It calls the engine and the control plane; the serving path never imports it.
"""
