"""CUDA-graph replay of whole forwards: one capture per input-shape key, then replays, so a warm
request launches one graph instead of thousands of kernels."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable

import torch

from ..cancel import shielded

from ..layouts.common import leaves, rebuild, skeleton


class GraphCache:
    """Capture `fn(inputs) -> tuple of tensors` per shape key, and replay it.
    `inputs`: a tensor, or a named tuple (a layout's `Inputs`) of tensors, nested tuples and None;
    the key must fix its structure (which fields are None) as it fixes the shapes.

    A capture runs `fn` once on a side stream (torch.compile's compiles and Triton's autotuning
    for the new sizes happen there, outside the capture), captures it, and replays: about twice a
    direct run's time, once. Where later requests reuse a key (a server pads varied text into
    captured shapes, `layouts.graph_plan`), the key's first use captures. Where nothing but the same
    input size reuses it (`capture_on_first_use=False`: an image size's vision tower), the first
    use runs `fn` directly and the second captures: a size seen once neither pays a capture nor
    evicts a graph. Inside `capturing_first_uses()` (a server's warmup, whose shapes are chosen
    because clients reuse them) every key is captured on its first use.
    Inputs are copied into static buffers (the tensors in field order; `fn` gets them rebuilt
    into the named tuple); a replay's outputs are the graph's own buffers, valid
    until the next replay of the same key (callers use them before the next request). Each entry
    keeps `fn`, so tensors `fn` closes over (which the graph reads) live as long as the graph.
    """

    def __init__(self, pool=None, max_graphs: int = 64):
        self.graphs: OrderedDict = OrderedDict()  # least recently replayed first
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.max_graphs = max_graphs
        self.seen: OrderedDict = OrderedDict()  # keys run directly once, not captured; oldest first, bounded
        self.every_first_use = False  # set by capturing_first_uses()
        self.last_run: str | None = None  # what the latest `run` did: "replay", "capture" or "direct"

    def __len__(self) -> int:
        return len(self.graphs)

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def keys(self):
        """The captured keys, least recently replayed first."""
        return self.graphs.keys()

    @contextmanager
    def capturing_first_uses(self):
        """Within it, `run` captures every key on its first use, whatever `capture_on_first_use` says."""
        before, self.every_first_use = self.every_first_use, True
        try:
            yield self
        finally:
            self.every_first_use = before

    def run(self, key, fn: Callable, inputs, capture_on_first_use: bool = True) -> tuple[torch.Tensor, ...]:
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            self.last_run = "replay"
        elif not (capture_on_first_use or self.every_first_use) and key not in self.seen:
            self.seen[key] = None
            while len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
            self.last_run = "direct"
            return fn(inputs)
        else:
            self.seen.pop(key, None)
            structure = skeleton(inputs)  # the graph keeps the structure, not these tensors
            entry = self._capture(key, lambda *tensors: fn(rebuild(structure, iter(tensors))), list(leaves(inputs)))
            self.last_run = "capture"
        graph, static_in, static_out, _ = entry
        for dst, src in zip(static_in, leaves(inputs), strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out

    def _capture(self, key, fn: Callable, inputs: list[torch.Tensor]):
        """`fn(*inputs)` on static copies of the flat tensors `inputs`, captured as the key's graph.
        A stop during the warm-up (cancel.py) leaves the cache as it was; the capture itself is
        shielded (no stop half-way), and the least recently used graph is evicted only once the new
        one is recorded, so a capture that fails costs no other graph."""
        static_in = [t.clone() for t in inputs]
        self._warm_up(fn, static_in)
        with shielded():
            graph, static_out = self._record(fn, static_in)
            while len(self.graphs) >= self.max_graphs:  # a server sees unbounded shape variety
                self.graphs.popitem(last=False)
            entry = self.graphs[key] = (graph, static_in, static_out, fn)
        return entry

    def _warm_up(self, fn: Callable, static_in: list[torch.Tensor]) -> None:
        """One run on a side stream, as torch.cuda.graph asks: lazy allocations, cuBLAS workspaces,
        and the compiles and autotuning a new size triggers, none of which can be captured."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                fn(*static_in)
        finally:  # also after a stop: the main stream must not reuse static_in's memory while the side stream reads it
            torch.cuda.current_stream().wait_stream(stream)

    def _record(self, fn: Callable, static_in: list[torch.Tensor]):
        """-> (the captured graph of `fn(*static_in)`, its output buffers)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = fn(*static_in)
        return graph, static_out
