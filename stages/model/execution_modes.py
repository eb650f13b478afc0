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


def resolve_execution(execution: str, device: str) -> str:
    """The mode ``execution`` runs as on ``device`` ("cpu", "cuda", "cuda:1"): ``auto``
    is compiled on a GPU (on an H200, 1.4x faster than eager for a 70B layer at one
    token and 1.7x for an 8B layer) and tuned on a CPU (compiled measured level with
    tuned there, for seconds of compile time per step shape)."""
    if execution != "auto":
        return execution
    return "compiled" if str(device).startswith("cuda") else "tuned"
