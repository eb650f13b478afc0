"""How a stage's forward runs: the names every flag, manifest and worker shares.

Torch-free, so the command line and the manifest schema name the modes without loading
torch; :mod:`stages.model.compiled` carries them out.
"""

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


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype ``dtype`` names on ``device``: ``auto`` is bfloat16 on a GPU and float32
    on a CPU. Measured (docs/benchmarks.md, "Execution"): a CPU without bf16 units runs a
    bf16 matmul of 4+ rows 1.4-4.6x slower than float32; an AMX Xeon ran bf16 stage steps
    faster but whole-model ar 22 % slower (56.8 against 46.5 ms a token)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def resolve_execution(execution: str, device: str) -> str:
    """The mode ``execution`` runs as on ``device`` ("cpu", "cuda", "cuda:1"): ``auto``
    is compiled on a GPU (on an H200, 1.4x faster than eager for a 70B layer at one
    token and 1.7x for an 8B layer) and tuned on a CPU (compiled measured level with
    tuned there, for seconds of compile time per step shape)."""
    if execution != "auto":
        return execution
    return "compiled" if str(device).startswith("cuda") else "tuned"
