"""CUDA-graph replay of whole forwards: one capture per input-shape key, then replays, so a warm
request launches one graph instead of thousands of kernels."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from ..cancel import shielded

from ..layouts.common import leaves, rebuild, skeleton


class GraphCache:
    """Capture `fn(inputs) -> tuple of tensors` per shape key on its second use, and replay it.
    `inputs`: a tensor, or a named tuple (a layout's `Inputs`) of tensors, nested tuples and None;
    the key must fix its structure (which fields are None) as it fixes the shapes.

    A key's first use runs `fn` directly: a capture costs a warm-up run and the capture itself,
    each about a direct run's time (launch-bound), and a server sees many shapes only once. The
    second use warms up on a side stream and captures; later uses replay.
    Inputs are copied into static buffers (the tensors in field order; `fn` gets them rebuilt
    into the named tuple); a replay's outputs are the graph's own buffers, valid
    until the next replay of the same key (callers use them before the next request). Each entry
    keeps `fn`, so tensors `fn` closes over (which the graph reads) live as long as the graph.
    """

    def __init__(self, pool=None, max_graphs: int = 64):
        self.graphs: OrderedDict = OrderedDict()  # least recently replayed first
        self.seen: OrderedDict = OrderedDict()  # keys run once, not captured (bounded like graphs)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.max_graphs = max_graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def run(self, key, fn: Callable, inputs) -> tuple[torch.Tensor, ...]:
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
        elif key not in self.seen:
            self.seen[key] = None
            while len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
            return fn(inputs)
        else:
            del self.seen[key]
            structure = skeleton(inputs)  # the graph keeps the structure, not these tensors
            with shielded():  # a cancelled request must not cut the warm-up and capture in half
                entry = self._capture(key, lambda *tensors: fn(rebuild(structure, iter(tensors))), list(leaves(inputs)))
        graph, static_in, static_out, _ = entry
        for dst, src in zip(static_in, leaves(inputs), strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out

    def _capture(self, key, fn: Callable, inputs: list[torch.Tensor]):
        """`fn(*inputs)` on static copies of the flat tensors `inputs`, captured as the key's graph."""
        while len(self.graphs) >= self.max_graphs:  # a server sees unbounded shape variety
            self.graphs.popitem(last=False)
        static_in = [t.clone() for t in inputs]
        # One run on a side stream first, as torch.cuda.graph asks (lazy allocations, cuBLAS
        # workspaces); Triton's autotuning already ran in the key's direct first use.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = fn(*static_in)
        entry = self.graphs[key] = (graph, static_in, static_out, fn)
        return entry
