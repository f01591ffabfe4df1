"""valen_runtime.fast.graphs: a key runs directly on its first use, is captured on its second and
replayed after, every use computing what a direct run computes."""

from __future__ import annotations

import pytest
import torch

from valen_runtime.fast.graphs import GraphCache

pytestmark = pytest.mark.gpu


def layer_like(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    """A few dependent kernels (GEMM, reduction, elementwise), like one layer's."""
    h = x @ w
    return (torch.nn.functional.silu(h) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),)


def test_the_second_use_captures_and_later_uses_replay_the_same_numbers():
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(96, 80, device="cuda", generator=gen, dtype=torch.bfloat16)
    cache = GraphCache(max_graphs=2)
    inputs = [torch.randn(37, 96, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4)]
    want = [layer_like(x, w)[0].clone() for x in inputs]
    fn = lambda x: layer_like(x, w)  # noqa: E731
    outs = []
    for use, x in enumerate(inputs):
        (out,) = cache.run(("layer", 37), fn, [x])
        outs.append(out)
        assert len(cache) == (0 if use == 0 else 1), use  # nothing captured on the first use
        assert torch.equal(out, want[use]), use  # fresh inputs each use: a stale static input would show
    assert outs[1].data_ptr() == outs[2].data_ptr() == outs[3].data_ptr()  # replays answer in the graph's buffer
    assert outs[0].data_ptr() != outs[1].data_ptr()


def test_graphs_and_first_uses_stay_bounded():
    w = torch.ones(8, 8, device="cuda")
    cache = GraphCache(max_graphs=2)
    for size in range(1, 6):
        for _ in range(2):
            cache.run(size, lambda x: (x @ w,), [torch.ones(size, 8, device="cuda")])
    assert list(cache.graphs) == [4, 5]  # least recently used graphs dropped
    for size in range(100, 120):
        cache.run(size, lambda x: (x @ w,), [torch.ones(3, 8, device="cuda")])
    assert len(cache.seen) == 4 * cache.max_graphs and 119 in cache.seen and 100 not in cache.seen
