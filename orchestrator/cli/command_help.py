"""Every ``treepipe`` command's one-line help, in the order ``--help`` lists them.

A leaf module (it imports nothing), so the top-level listing is built without
importing any command's module, and each module registering a command reads its help
from here: one string per command.
"""

from __future__ import annotations

# in build_parser()'s order; test_light_commands checks the order against the full parser
COMMANDS: dict[str, str] = {
    "generate": "generate text with a pipelined model",
    "serve": "serve a model on this machine (OpenAI HTTP API + gRPC) until Ctrl-C",
    "chaos": "requests through a local pipeline while random processes (stages, draft, "
             "gateway, redis) are killed; --fuzz: the long run of the fuzz suites",
    "bench": "benchmark ar / pp / specinfer / specpipe on the same prompts",
    "sweep": "parameter sweeps that reproduce the paper's figures 7, 9 and 10",
    "simulate": "check the simulator against a recorded run's pipelined time",
    "project": "simulate the paper's 70B / 8×RTX 3090 testbed",
    "tune": "choose w and k by minimising Eq. (1) with measured t_i(w) and P(w)",
    "timeline": "Figure-12-style device timeline of one request",
    "draft": "draft service and draft training",
    "stage": "run one stage worker (started by treepipe up)",
    "link-keys": "write a pipeline's stage-link keys to a directory (for "
                 "$TREEPIPE_LINK_KEYS; treepipe up makes its own)",
    "gateway": "run the gRPC gateway of a pipeline (started by up)",
    "up": "run a backend: local pipeline on this machine",
    "down": "stop a local pipeline started by treepipe up (even one whose supervisor was "
            "killed)",
    "scale": "change the stage count of a running pipeline (local, or a TreePipeline in a "
             "cluster)",
    "status": "stages, epoch and health of a pipeline (local, or a TreePipeline in a cluster)",
    "top": "live view of a local pipeline: workers (heartbeat, plan, step, utilisation) and "
           "gateway (queue, hit rate, TTFT/TBT)",
    "runtime-bench": "synchroniser and transfer cost per step; multi-process TBT",
    "bench-serve": "vllm bench serve-style load on an OpenAI API: throughput, TTFT, TPOT and "
                   "ITL at each concurrency",
    "plan": "plan a TreePipeline manifest: layers, memory, racks",
    "render": "print the Kubernetes objects of a manifest",
    "crd": "print the TreePipeline CustomResourceDefinition",
    "manifest-docs": "print the manifest reference (Markdown)",
    "model": "manage models",
}
