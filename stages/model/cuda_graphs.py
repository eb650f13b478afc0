"""A stage's layers replayed as CUDA graphs, one per step bucket.

On a GPU an eager step launches some 70 kernels per layer, each a few microseconds of
Python and driver work, so a small step waits on the CPU rather than on the weights.
A CUDA graph records every launch of all the stage's layers once and replays them
with one call. Graphs need fixed shapes and fixed addresses, so each step is padded
to its bucket (:mod:`stages.model.step_buckets`), copied into the bucket's own input
buffers, and replayed; the pool's address is part of the key, and a pool that grows
drops the graphs recorded over the old one. Graphs are recorded on first use; every
graph of a shard shares one memory pool, since steps run one at a time.

Without ``capture`` (any device) the padded step runs as it is: the padding itself,
checked on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from stages.model.model import RowIndex
from stages.model.step_buckets import BucketKey, PaddedStep, pad_step

# what runs the layers: StageShard.layer_loop's signature
Layers = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, RowIndex], Tensor]


class _Graph:
    """One bucket's recorded step: its input buffers, the graph and its output."""

    def __init__(self, layers: Layers, step: PaddedStep, k_pool: Tensor, v_pool: Tensor,
                 memory: tuple[int, int]):
        self.inputs = [t.clone() for t in _flat(step)]
        h, cos, sin, *rows = self.inputs
        index = RowIndex(*rows)
        # warm up outside the recording (cuBLAS handles, compiled kernels); this run is
        # the real step, and the first replay writes the same K/V again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layers(h, cos, sin, k_pool, v_pool, index)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=memory):
            self.out = layers(h, cos, sin, k_pool, v_pool, index)

    def replay(self, step: PaddedStep) -> Tensor:
        """Load ``step`` into the input buffers and replay; the padded output."""
        for dst, src in zip(self.inputs, _flat(step), strict=True):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.out


def _flat(step: PaddedStep) -> list[Tensor]:
    rows = step.rows
    assert rows.mask is not None  # a padded step always has its mask
    return [step.h, step.cos, step.sin, *rows[:4], rows.mask]


class StepGraphs:
    """Runs a shard's layers (``layers``) as padded, captured steps."""

    def __init__(self, layers: Layers, capture: bool = True):
        self.layers, self.capture = layers, capture
        self.graphs: dict[BucketKey, _Graph] = {}
        self._pool_at: tuple[int, int] | None = None
        self._memory: tuple[int, int] | None = None

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                 rows: RowIndex) -> Tensor:
        """The layers over ``h``, as :meth:`StageShard.layer_loop` computes them."""
        step = pad_step(h, cos, sin, rows, k_pool.shape[2] - 1)
        if step is None:  # past the largest bucket: eager, unpadded
            return self.layers(h, cos, sin, k_pool, v_pool, rows)
        if not self.capture:
            return self.layers(step.h, step.cos, step.sin, k_pool, v_pool, step.rows)[:step.n]
        at = (k_pool.data_ptr(), v_pool.data_ptr())
        if at != self._pool_at:  # a new or grown pool: the old graphs point elsewhere
            # their memory pool goes with them (torch frees a pool no graph holds, and
            # refuses to record into its stale handle)
            self.graphs.clear()
            self._pool_at, self._memory = at, None
        graph = self.graphs.get(step.key)
        if graph is None:
            if self._memory is None:
                self._memory = torch.cuda.graph_pool_handle()
            graph = self.graphs[step.key] = _Graph(self.layers, step, k_pool, v_pool,
                                                   self._memory)
        return graph.replay(step)[:step.n].clone()


__all__ = ["StepGraphs"]
