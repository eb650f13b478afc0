"""How a stage's forward runs: the names every flag, manifest and worker shares.

Torch-free, so the command line and the manifest schema name the modes without loading
torch; :mod:`stages.model.compiled` carries them out.
"""

# eager: plain PyTorch and the untuned kernel rule (what every release before had, for
# debugging); tuned: eager layers on the matmul kernels measured fastest on this machine
# (stages.model.linear_tuning); compiled: tuned, with each layer a compiled graph
EXECUTION_MODES = ("eager", "tuned", "compiled")
# the default: measured faster than eager on the development CPU (1 and 4 rows 14-19 %
# faster, 16 and 64 level); compiled measured level with tuned there, for its compile time
DEFAULT_EXECUTION = "tuned"
