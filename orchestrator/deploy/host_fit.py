"""Whether a ``backend: local`` plan fits the machine it is about to run on.

The planner checks a stage against ``device.memory`` when a manifest gives it; a
local pipeline runs every stage, the draft and the gateway as processes of *this*
machine, so ``treepipe plan``, ``up`` and ``scale`` also add up what its processes
need on each device and refuse a plan that the kernel would otherwise OOM-kill one
process at a time.  CPU components share the host's RAM (or the cgroup's limit);
CUDA components share the GPU the workers open (``--device cuda``: GPU 0 of what
``CUDA_VISIBLE_DEVICES`` shows).  torch is imported only when a component names
``cuda``: planning a CPU manifest stays torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from orchestrator.deploy.manifest import ManifestError, TreePipeline
from orchestrator.deploy.planner import GIB, MIB, Memory, Plan, draft_names, is_path_like
from orchestrator.models.registry import CONFIG_FILE

# the share of a device's memory a plan may count on: the estimate leaves out the
# allocator's fragmentation, the OS and whatever else runs on the machine
MARGIN = 0.10
# a worker process's own resident memory before its weights: Python, torch and its
# kernels (measured about 225 MiB for `import torch` on CPU)
PROCESS_MIB = 300
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
                 Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))  # v1


def host_memory_bytes() -> int:
    """This machine's RAM, or the container's cgroup limit if that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in CGROUP_LIMITS:
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means none; v1 writes a huge number instead
            total = min(total, int(text))
    return total


def gpu_memory_bytes() -> int | None:
    """Total memory of the GPU a ``--device cuda`` worker opens; None without a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def _device_field(m: TreePipeline, i: int) -> str:
    """The manifest field that sets stage ``i``'s device type."""
    st = m.spec.stages
    o = st.override(i)
    if o is not None and o.device is not None:
        return f"spec.stages.overrides[{st.overrides.index(o)}].device.type"
    return "spec.stages.device.type"


def _components(m: TreePipeline, p: Plan) -> list[tuple[str, str, str, Memory]]:
    """(what, manifest field of its device type, device type, estimate) of every worker."""
    out = []
    for s in p.stages:
        out.append((f"stage {s.index} (layers {s.layers[0]}-{s.layers[1]})",
                    _device_field(m, s.index), s.device.type, s.memory))
    out.append(("the draft", "spec.draft.device.type", p.draft.device.type, p.draft.memory))
    return out


# what to lower for the largest part of an estimate: a local pipeline's stages share one
# machine, so more stages would not help
_FIXES = {
    "weights": ("spec.model", "the model's weights do not fit; use a smaller model or "
                              "model.dtype bfloat16"),
    "kv": ("spec.memory.kvTokens", "most is the KV pool; lower memory.kvTokens, "
                                   "limits.concurrency or limits.contextLength"),
    "tree": ("spec.draft.width", "most is the tree buffers and activations of "
                                 "draft.width nodes per request; lower draft.width or "
                                 "limits.concurrency"),
}


def check_host_fit(m: TreePipeline, p: Plan,
                   host_bytes: Callable[[], int] = host_memory_bytes,
                   gpu_bytes: Callable[[], int | None] = gpu_memory_bytes) -> None:
    """Refuse a ``backend: local`` plan this machine cannot run (ManifestError, one line).

    A ``cuda`` device without a visible GPU, a local draft path that does not exist, and
    the processes' estimated memory (weights, KV pool, tree buffers, activations,
    runtime, and each process's own) above the device's less :data:`MARGIN`.  Other
    backends run elsewhere: nothing of this machine is checked for them.
    """
    if m.spec.backend != "local":
        return
    _check_draft_paths(m)
    parts = _components(m, p)
    cuda = [c for c in parts if c[2] == "cuda"]
    if cuda:
        cap = gpu_bytes()
        if cap is None:
            what, where, _, _ = cuda[0]
            raise ManifestError(f"{where}: cuda, but this machine has no CUDA GPU that torch "
                                f"can see (for {what}); set it to cpu, or run the pipeline "
                                f"where a GPU is")
        _check_sum("GPU 0", cap, cuda, extra=0)
    cpu = [c for c in parts if c[2] == "cpu"]
    # every worker process holds Python and torch in host RAM, a GPU worker too
    _check_sum("host RAM", host_bytes(), cpu, extra=len(parts) * PROCESS_MIB * MIB)


def _check_sum(device: str, cap: int, parts: list[tuple[str, str, str, Memory]],
               extra: int) -> None:
    need = sum(c[3].total for c in parts) + extra
    usable = int(cap * (1 - MARGIN))
    if need <= usable or not parts:
        return
    shares = {"weights": sum(c[3].weights for c in parts), "kv": sum(c[3].kv for c in parts),
              "tree": sum(c[3].tree + c[3].activations for c in parts)}
    field, fix = _FIXES[max(shares, key=lambda k: shares[k])]
    raise ManifestError(
        f"{field}: the local pipeline needs about {need / GIB:.2f} GiB of {device} (weights "
        f"{shares['weights'] / GIB:.2f}, KV {shares['kv'] / GIB:.2f}, tree and activations "
        f"{shares['tree'] / GIB:.2f}) but this machine has {cap / GIB:.2f} GiB, "
        f"{usable / GIB:.2f} usable; {fix}, or run it on a bigger machine")


def _check_draft_paths(m: TreePipeline) -> None:
    """A draft model named by a path must be on this machine (a local draft service
    loads it); bare names the planner checked already."""
    d = m.spec.draft
    for where, src in (("source", d.source), ("model", d.model if d.source == "hybrid" else "")):
        if not is_path_like(src):
            continue
        path = Path(src).expanduser()
        if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
            raise ManifestError(f"spec.draft.{where}: {src!r} does not exist on this machine; "
                                f"point it at a model folder (with {CONFIG_FILE}) or a .gguf "
                                f"file, or use one of {', '.join(draft_names())}")
