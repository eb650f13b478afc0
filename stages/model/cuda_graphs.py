"""A stage's layers replayed as CUDA graphs, one per step bucket.

On a GPU an eager step launches some 70 kernels per layer, each a few microseconds of
Python and driver work, so a small step waits on the CPU rather than on the weights.
A CUDA graph records every launch of all the stage's layers once and replays them
with one call. Graphs need fixed shapes and fixed addresses, so each step is padded
to its bucket (:mod:`stages.model.step_buckets`), copied into the bucket's own input
buffers, and replayed. The KV pool's address and shape are part of the key: graphs are
kept for the :data:`POOLS_KEPT` pools used last, since a stage's steps can alternate
between pools (each of the runs ``treepipe bench --concurrency`` steps in turn has its
own; the engine gives each single request one). On the H200 that bench, when a pool
change dropped every graph, recorded 5573 graphs for some 4500 stage steps and ran
1.3-1.7x slower than eager. Graphs are recorded on first use; every graph of a shard
shares one memory pool, since steps run one at a time.

Without ``capture`` (any device) the padded step runs as it is: the padding itself,
checked on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import Tensor

from stages.model.model import RowIndex
from stages.model.step_buckets import BucketKey, PaddedStep, pad_step

# what runs the layers: StageShard.layer_loop's signature
Layers = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, RowIndex], Tensor]
# a KV pool as a graph sees it: where its K and V live and their shape (a pool freed and
# another allocated at the same address with the same shape is laid out alike)
PoolKey = tuple[int, int, tuple[int, ...]]
# pools whose graphs stay recorded; older pools' graphs are dropped (more runs stepped
# in turn than this record again every step)
POOLS_KEPT = 8
G = TypeVar("G")


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


class GraphStore(Generic[G]):
    """Recorded graphs by (pool, bucket), for the :data:`POOLS_KEPT` pools used last."""

    def __init__(self, pools_kept: int = POOLS_KEPT):
        self.pools_kept = pools_kept
        self.graphs: dict[PoolKey, dict[BucketKey, G]] = {}  # oldest pool first

    def get(self, pool: PoolKey, key: BucketKey) -> G | None:
        """The graph recorded for ``key`` over ``pool``; marks ``pool`` as used last."""
        graphs = self.graphs.pop(pool, {})
        self.graphs[pool] = graphs
        while len(self.graphs) > self.pools_kept:
            del self.graphs[next(iter(self.graphs))]
        return graphs.get(key)

    def put(self, pool: PoolKey, key: BucketKey, graph: G) -> None:
        """Keep ``graph`` for ``key`` over ``pool`` (after :meth:`get` for the same pool)."""
        self.graphs[pool][key] = graph

    def __len__(self) -> int:
        return sum(len(g) for g in self.graphs.values())


class StepGraphs:
    """Runs a shard's layers (``layers``) as padded, captured steps."""

    def __init__(self, layers: Layers, capture: bool = True):
        self.layers, self.capture = layers, capture
        self.store: GraphStore[_Graph] = GraphStore()
        self._memory: tuple[int, int] | None = None

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                 rows: RowIndex) -> Tensor:
        """The layers over ``h``, as :meth:`StageShard.layer_loop` computes them."""
        step = pad_step(h, cos, sin, rows, k_pool.shape[2] - 1)
        if step is None:  # past the largest bucket: eager, unpadded
            return self.layers(h, cos, sin, k_pool, v_pool, rows)
        if not self.capture:
            return self.layers(step.h, step.cos, step.sin, k_pool, v_pool, step.rows)[:step.n]
        pool = (k_pool.data_ptr(), v_pool.data_ptr(), tuple(k_pool.shape))
        graph = self.store.get(pool, step.key)
        if graph is None:
            # torch frees a memory pool no graph holds, and refuses to record into its
            # stale handle: a fresh one whenever no graph is kept
            if self._memory is None or not len(self.store):
                self._memory = torch.cuda.graph_pool_handle()
            graph = _Graph(self.layers, step, k_pool, v_pool, self._memory)
            self.store.put(pool, step.key, graph)
        return graph.replay(step)[:step.n].clone()


__all__ = ["POOLS_KEPT", "GraphStore", "StepGraphs"]
