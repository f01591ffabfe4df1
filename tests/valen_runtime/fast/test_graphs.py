"""valen_runtime.fast.graphs: a key is captured on its first use (after a warm-up run) and
replayed after, every use computing what a direct run computes (on CUDA); the same policy with
torch.cuda's graph API faked (on the CPU, so CI holds it)."""

from __future__ import annotations

import pytest
import torch

from valen_runtime.fast.graphs import GraphCache

from ..conftest import cpu_graphs

gpu = pytest.mark.gpu


def layer_like(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    """A few dependent kernels (GEMM, reduction, elementwise), like one layer's."""
    h = x @ w
    return (torch.nn.functional.silu(h) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),)


@gpu
def test_the_first_use_captures_and_later_uses_replay_the_same_numbers():
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(96, 80, device="cuda", generator=gen, dtype=torch.bfloat16)
    cache = GraphCache(max_graphs=2)
    inputs = [torch.randn(37, 96, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4)]
    want = [layer_like(x, w)[0].clone() for x in inputs]
    fn = lambda x: layer_like(x, w)  # noqa: E731
    outs = []
    for use, x in enumerate(inputs):
        (out,) = cache.run(("layer", 37), fn, x)
        outs.append(out)
        assert len(cache) == 1, use  # captured on the first use
        assert torch.equal(out, want[use]), use  # fresh inputs each use: a stale static input would show
    assert outs[0].data_ptr() == outs[1].data_ptr() == outs[3].data_ptr()  # every use answers in the graph's buffer


@gpu
def test_graphs_stay_bounded():
    w = torch.ones(8, 8, device="cuda")
    cache = GraphCache(max_graphs=2)
    for size in range(1, 6):
        for _ in range(2):
            (out,) = cache.run(size, lambda x: (x @ w,), torch.ones(size, 8, device="cuda"))
            assert torch.equal(out, torch.full((size, 8), 8.0, device="cuda"))
    assert list(cache.graphs) == [4, 5]  # least recently used graphs dropped


# ---- the capture policy on the CPU (CI has no GPU): torch.cuda's graph API replaced by a fake
# whose capture records the function and whose replay runs it again on the static inputs.


class FakeGraph:
    captures = 0

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1
        outputs = FakeGraph.recording["fn"](*FakeGraph.recording["inputs"])
        for dst, src in zip(self.outputs, outputs):
            dst.copy_(src)


def record_captures(cache: GraphCache, monkeypatch) -> None:
    """Make each capture of `cache` the one FakeGraph replays: its function on its static buffers."""
    real_capture = cache._capture

    def capture(key, fn, inputs):
        entry = real_capture(key, fn, inputs)
        graph, static_in, static_out, _ = entry
        graph.outputs = static_out
        FakeGraph.recording = {"fn": fn, "inputs": static_in}
        return entry

    monkeypatch.setattr(cache, "_capture", capture)


class FakeCuda:
    """The pieces of torch.cuda GraphCache uses; `graph(g)` records the next call's function."""

    def __init__(self, monkeypatch):
        self.graph_objects = []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(cuda, "Stream", FakeStream)
        monkeypatch.setattr(cuda, "current_stream", FakeStream)
        monkeypatch.setattr(cuda, "stream", lambda s: _null())
        monkeypatch.setattr(cuda, "CUDAGraph", self.new_graph)
        monkeypatch.setattr(cuda, "graph", self.capture)

    def new_graph(self):
        g = FakeGraph()
        self.graph_objects.append(g)
        return g

    def capture(self, graph, pool=None):
        FakeGraph.captures += 1
        return _null()


class FakeStream:
    def wait_stream(self, other):
        pass


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_capture_policy_first_use_warms_up_and_captures_then_replays_cpu(monkeypatch):
    """First use: fn runs on static copies of the inputs (a warm-up, then the capture), then a
    replay answers (its outputs the captured ones). Later uses: replays only. Least recently used
    graphs are dropped past max_graphs."""
    FakeCuda(monkeypatch)
    FakeGraph.captures = 0
    calls = []

    def fn(x):
        calls.append(x)
        return (x * 2,)

    cache = GraphCache(max_graphs=2)
    record_captures(cache, monkeypatch)
    first = torch.full((3,), 5.0)
    (out,) = cache.run("k", fn, first)
    assert torch.equal(out, torch.full((3,), 10.0)) and FakeGraph.captures == 1 and len(cache) == 1
    assert len(calls) == 2 + 1 and all(c is not first for c in calls)  # warm-up, capture, replay: static inputs
    (again,) = cache.run("k", fn, torch.full((3,), 7.0))
    assert again is out and torch.equal(again, torch.full((3,), 14.0)) and FakeGraph.captures == 1  # a replay
    for key in ("a", "a", "b", "b"):
        cache.run(key, fn, torch.ones(1))
    assert list(cache.graphs) == ["a", "b"] and FakeGraph.captures == 3  # "k" dropped, least recently used


def test_named_inputs_reach_fn_as_the_same_named_tuple_cpu(monkeypatch):
    """A layout's inputs (a named tuple with a nested named tuple and a None field) go into static
    buffers field by field and come back to `fn` as the same named tuple: direct, captured and
    replayed uses all see fresh values in their own fields."""
    from typing import NamedTuple

    class Inner(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    class Inputs(NamedTuple):
        x: torch.Tensor
        inner: Inner
        features: torch.Tensor | None = None

    FakeCuda(monkeypatch)
    seen = []

    def fn(inputs):
        assert type(inputs) is Inputs and type(inputs.inner) is Inner and inputs.features is None
        seen.append(inputs)
        return (inputs.x * 100 + inputs.inner.a * 10 + inputs.inner.b,)

    cache = GraphCache(max_graphs=2)
    record_captures(cache, monkeypatch)
    for use in range(4):  # capture (+ its replay), replays
        inputs = Inputs(torch.full((2,), float(use)), Inner(torch.full((2,), 1.0 + use), torch.full((2,), 2.0 + use)))
        (out,) = cache.run("k", fn, inputs)
        assert torch.equal(out, torch.full((2,), 100.0 * use + 10 * (1 + use) + 2 + use)), use
    assert seen[0].x.data_ptr() == seen[-1].x.data_ptr() and len(cache) == 1  # every use reads the static copies


def test_a_key_reused_only_by_its_own_size_runs_directly_first_and_captures_on_its_second_use_cpu(monkeypatch):
    """capture_on_first_use=False (an image size's vision tower): the first use runs `fn` on the
    caller's inputs with nothing captured or evicted; the second captures, later ones replay; the
    keys remembered as seen once stay bounded."""
    FakeCuda(monkeypatch)
    FakeGraph.captures = 0
    calls = []

    def fn(x):
        calls.append(x)
        return (x * 3,)

    cache = GraphCache(max_graphs=1)
    record_captures(cache, monkeypatch)
    cache.run("text", fn, torch.ones(1))  # a key that captures on its first use
    first = torch.full((2,), 2.0)
    (out,) = cache.run(("vision", 1), fn, first, capture_on_first_use=False)
    assert torch.equal(out, torch.full((2,), 6.0)) and calls[-1] is first  # direct, on the caller's tensor
    assert list(cache.keys()) == ["text"] and FakeGraph.captures == 1 and cache.last_run == "direct"  # nothing captured, nothing evicted
    (out,) = cache.run(("vision", 1), fn, torch.full((2,), 5.0), capture_on_first_use=False)
    assert torch.equal(out, torch.full((2,), 15.0)) and list(cache.keys()) == [("vision", 1)] and FakeGraph.captures == 2
    assert cache.last_run == "capture"
    (again,) = cache.run(("vision", 1), fn, torch.full((2,), 7.0), capture_on_first_use=False)
    assert again is out and torch.equal(again, torch.full((2,), 21.0)) and FakeGraph.captures == 2 and cache.last_run == "replay"
    for size in range(100):  # sizes seen once: remembered up to 4 x max_graphs, oldest forgotten first
        cache.run(("vision", 100 + size), fn, torch.ones(1), capture_on_first_use=False)
    assert list(cache.seen) == [("vision", 100 + size) for size in range(96, 100)] and FakeGraph.captures == 2


def test_a_failed_capture_evicts_no_other_graph_cpu(monkeypatch):
    cache = cpu_graphs(max_graphs=1)
    cache.run("older", lambda x: (x + 1,), torch.zeros(1))

    def out_of_memory(fn, static_in):
        raise RuntimeError("out of memory in the graph pool")

    monkeypatch.setattr(cache, "_record", out_of_memory)
    with pytest.raises(RuntimeError, match="graph pool"):
        cache.run("new", lambda x: (x + 1,), torch.zeros(2))
    assert list(cache.keys()) == ["older"]


def test_a_stop_in_the_warm_up_still_joins_the_side_stream_cpu(monkeypatch):
    """The warm-up runs on a side stream reading the static inputs: after a stop there the main
    stream must still wait for it, or the inputs' memory, freed with the stop, could be handed to
    the next request while side-stream kernels still read it."""
    from valen_runtime import cancel

    FakeCuda(monkeypatch)
    joins = []

    class MainStream(FakeStream):
        def wait_stream(self, other):
            joins.append(type(other).__name__)

    monkeypatch.setattr(torch.cuda, "current_stream", MainStream)

    def stopped_layer(x):
        cancel.checkpoint()
        return (x + 1,)

    with cancel.scope(lambda: True), pytest.raises(cancel.Cancelled):
        GraphCache(max_graphs=2).run("k", stopped_layer, torch.zeros(2))
    assert joins == ["FakeStream"]  # the main stream waited for the side stream once


def test_capturing_first_uses_is_restored_after_nesting_and_an_exception():
    """`capturing_first_uses()` (a server's warmup) makes a key that would wait for its second use
    capture on its first; leaving it, also by an exception and from inside a nested use, restores
    the policy."""
    cache = cpu_graphs()
    double = lambda x: (x * 2,)  # noqa: E731
    with cache.capturing_first_uses():
        with cache.capturing_first_uses():
            cache.run("inner", double, torch.ones(2), capture_on_first_use=False)
        assert cache.every_first_use  # the outer use still holds
        cache.run("outer", double, torch.ones(3), capture_on_first_use=False)
    assert cache.captures == 2 and not cache.every_first_use
    with pytest.raises(RuntimeError, match="stop"):
        with cache.capturing_first_uses():
            raise RuntimeError("stop")
    assert not cache.every_first_use
    (out,) = cache.run("after", double, torch.ones(4), capture_on_first_use=False)
    assert cache.captures == 2 and "after" not in cache and torch.equal(out, torch.full((4,), 2.0))
