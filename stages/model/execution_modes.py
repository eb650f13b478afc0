"""How a stage's forward runs: the names every flag, manifest and worker shares.

Torch-free, so the command line and the manifest schema name the modes without loading
torch; :mod:`stages.model.compiled` carries them out.
"""

from functools import cache
from pathlib import Path

# auto: what measured fastest on the device (resolve_execution); eager: plain PyTorch
# and the untuned kernel rule (what every release before had, for debugging); tuned:
# eager layers on the CPU matmul kernels measured fastest on this machine
# (stages.model.linear_tuning); compiled: tuned, with each layer a compiled graph and,
# on a GPU, each step replayed as a CUDA graph (stages.model.cuda_graphs)
EXECUTION_MODES = ("auto", "eager", "tuned", "compiled")
DEFAULT_EXECUTION = "auto"


DEFAULT_DTYPE = "auto"

# none: weights in the model's dtype; int8: weight-only int8, one scale per output row
# (stages.model.quantization), what vLLM's --quantization names
QUANTIZE_MODES = ("none", "int8")
DEFAULT_QUANTIZE = "none"


# CPU flags of bf16 matrix units: AVX-512 BF16 (AMD Zen 4 on, Intel Cooper Lake on) and AMX
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def bf16_units(cpuinfo: str) -> bool:
    """Whether a ``/proc/cpuinfo`` text names a CPU with bf16 matrix units."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return not BF16_FLAGS.isdisjoint(line.partition(":")[2].split())
    return False


@cache
def host_cpuinfo() -> str:
    """This machine's ``/proc/cpuinfo`` ("" where there is none), read once."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def host_has_bf16_units() -> bool:
    """Whether this machine's CPU has bf16 matrix units (False where it cannot tell)."""
    return bf16_units(host_cpuinfo())


def resolve_dtype(dtype: str, device: str, here: bool = True) -> str:
    """The dtype ``dtype`` names on ``device``: ``auto`` is bfloat16 on a GPU and on a CPU
    with bf16 units, float32 on other CPUs and on CPUs not ``here`` (on this machine),
    whose units are unknown. Measured (docs/benchmarks.md, "Execution"),
    SmolLM2 ar: on an AMD EPYC with AVX-512 BF16 bf16 ran at 1.20x float32's speed on 1
    thread and 1.03x on 2 (one process, interleaved: docs/bench/execution/ar_ab.py), on
    an AMX Xeon 1.29x on 2 threads (35.8 against 46.2 ms a token), in half the memory; a
    CPU without bf16 units runs a bf16 matmul of 4+ rows 1.4-4.6x slower than float32."""
    if dtype != "auto":
        return dtype
    if str(device).startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if here and host_has_bf16_units() else "float32"


def resolve_execution(execution: str, device: str) -> str:
    """The mode ``execution`` runs as on ``device`` ("cpu", "cuda", "cuda:1"): ``auto``
    is compiled on a GPU (on an H200, 1.4x faster than eager for a 70B layer at one
    token and 1.7x for an 8B layer) and tuned on a CPU (compiled measured level with
    tuned there, for seconds of compile time per step shape)."""
    if execution != "auto":
        return execution
    return "compiled" if str(device).startswith("cuda") else "tuned"
