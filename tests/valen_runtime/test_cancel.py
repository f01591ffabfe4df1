"""valen_runtime.cancel: work under a scope stops at the model's next layer once the scope says stop;
outside a scope nothing changes (the tiny fixture export on the CPU)."""

from __future__ import annotations

import pytest

from valen_runtime import cancel

MODEL = "valen-preview-0923"
QUESTIONS = {f"q{i}": {"type": "noul", "instructions": f"Is claim {i} true?"} for i in range(2)}


def counting_stop(after: int | None):
    """A stop test that counts its calls and says stop from call `after` on (None: never)."""
    calls = []

    def stop() -> bool:
        calls.append(None)
        return after is not None and len(calls) >= after

    return stop, calls


def test_checkpoint_raises_only_inside_a_scope_that_says_stop():
    cancel.checkpoint()  # no scope: nothing happens
    with cancel.scope(lambda: False):
        cancel.checkpoint()
        with cancel.scope(lambda: True):
            with pytest.raises(cancel.Cancelled):
                cancel.checkpoint()
        cancel.checkpoint()  # the outer scope is back
    cancel.checkpoint()


@pytest.fixture(scope="module")
def engines(tiny_export):
    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions

    export = tiny_export["separate"]
    return {"per-branch": Engine.load(export, EngineOptions(device="cpu")),
            "batching": Engine.load(export, EngineOptions(device="cpu", mode="shared-prefix", kernels="fast"))}


@pytest.mark.parametrize("kind", ["per-branch", "batching"])
def test_a_cancelled_run_stops_at_the_next_layer(engines, kind, long_image_request, short_request):
    """The stop test is read before every layer of the vision tower and the text stack; once it says
    stop, the run raises Cancelled and reads it no more (no further layer ran)."""
    engine = engines[kind]
    request = {**long_image_request, "questions": QUESTIONS}
    stop, layers = counting_stop(None)
    with cancel.scope(stop):
        engine.run(request)
    assert len(layers) > 6  # vision blocks and text layers, per branch in the per-branch mode
    stop, calls = counting_stop(after=4)
    with cancel.scope(stop), pytest.raises(cancel.Cancelled):
        engine.run(request)
    assert len(calls) == 4
    assert engine.run(short_request).response["answers"].keys() == short_request["questions"].keys()  # unaffected afterwards


def test_a_cancelled_batch_is_not_rerun_request_by_request(engines, batch_requests):
    """A failed combined sweep reruns each request alone; a cancelled one must not: every request
    gets Cancelled."""
    engine = engines["batching"]
    assert engine.batches
    prepared = engine.prepare_many(batch_requests)
    stop, calls = counting_stop(after=1)
    with cancel.scope(stop):
        results = engine.collect(engine.launch(prepared))
    assert [type(r) for r in results] == [cancel.Cancelled] * len(batch_requests)
    assert len(calls) == 1


@pytest.mark.gpu
def test_cancelling_on_cuda_leaves_the_graph_cache_usable(tiny_export, short_request):
    """On CUDA with graphs, as served (compiled): a run stopped in its shape's first use (in the
    warm-up before the capture) captures nothing, and the engine then answers exactly as one that
    was never cancelled, capture and replay alike."""
    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions

    options = EngineOptions(device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast", graphs=True)
    cancelled, untouched = (Engine.load(tiny_export["separate"], options) for _ in range(2))
    long_text = dict(short_request, state=" ".join(["the order was charged twice and the customer asked for a refund"] * 12))
    for request in (short_request, long_text):
        captured, replayed = (untouched.run(request).response for _ in range(2))
        graphs_before = len(cancelled.graphs)
        with cancel.scope(lambda: True), pytest.raises(cancel.Cancelled):  # stopped in the warm-up
            cancelled.run(request)
        assert len(cancelled.graphs) == graphs_before
        assert cancelled.run(request).response == captured
        assert cancelled.run(request).response == replayed


def test_a_graph_capture_is_never_cut_by_a_cancelled_scope():
    """GraphCache's first use of a key warms up, then captures: a stop during the warm-up leaves the
    cache as it was (no graph evicted, none added); the capture itself is never cut in half (the
    key would lose its graph, an older one already evicted). On the CPU, the warm-up and capture
    replaced by direct runs, each passing a checkpoint."""
    import torch

    from valen_runtime.fast.graphs import GraphCache

    class CpuGraphs(GraphCache):
        stop_in_capture = False

        def _warm_up(self, fn, static_in):
            fn(*static_in)

        def _record(self, fn, static_in):
            self.stop_in_capture = True  # the stop test below says stop from here on
            return type("Replay", (), {"replay": lambda self: None})(), fn(*static_in)

    graphs = CpuGraphs(pool="none on the CPU", max_graphs=1)

    def layer_stack(x):
        cancel.checkpoint()
        return (x + 1,)

    graphs.run("older", layer_stack, torch.zeros(1))
    with cancel.scope(lambda: True), pytest.raises(cancel.Cancelled):  # stopped in the warm-up
        graphs.run("key", layer_stack, torch.zeros(2))
    assert list(graphs.keys()) == ["older"]  # nothing evicted, nothing added
    graphs.stop_in_capture = False
    with cancel.scope(lambda: graphs.stop_in_capture):  # stop says stop once the capture has begun
        graphs.run("key", layer_stack, torch.zeros(2))
    assert list(graphs.keys()) == ["key"]
    cancel.checkpoint()  # the shield ends with the capture
    with cancel.scope(lambda: True), pytest.raises(cancel.Cancelled):
        cancel.checkpoint()
