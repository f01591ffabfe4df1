"""Engine and valen-run end to end on the tiny export: the modes and layouts against the
per-branch reference shape, the fast path against the reference modules, CUDA graphs against
direct execution, import hygiene, CLI exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from valen_runtime.cli import main as valen_run
from valen_runtime.engine import Engine
from valen_runtime.options import EngineOptions

from .conftest import cpu_graphs, png_data_url

TEXT_REQUEST = {
    "model": "valen-preview-0923",
    "state": "The card was charged twice for one order.",
    "questions": {
        "next": {"type": "choice", "instructions": "What next?", "criteria": {"refund": "Refund it", "wait": "Wait"}},
        "dup": {"type": "noul", "instructions": "Is it a duplicate?"},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
    },
}


def test_loading_and_running_never_imports_transformers_peft_or_torch_load(tiny_export):
    code = (
        "import json, sys, torch\n"
        "calls = []\n"
        "real = torch.load\n"
        "torch.load = lambda *a, **k: calls.append(a) or real(*a, **k)\n"
        "from valen_runtime.engine import Engine\n"
        "from valen_runtime.options import EngineOptions\n"
        f"e = Engine.load({str(tiny_export['separate'])!r}, EngineOptions(device='cpu', dtype='bf16'))\n"
        f"e.answer(json.loads({json.dumps(json.dumps(TEXT_REQUEST))}))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('peft', 'torchvision') or m.startswith('transformers'))\n"
        "print(json.dumps({'bad': bad, 'torch_load_calls': len(calls)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"bad": [], "torch_load_calls": 0}


def test_response_shape_and_usage(tiny_export):
    result = Engine.load(tiny_export["merged"], EngineOptions(device="cpu", dtype="fp32")).run(TEXT_REQUEST)
    resp = result.response
    assert list(resp) == ["model", "answers", "usage", "internal_usage"]
    assert resp["model"] == "valen-preview-0923"
    assert list(resp["answers"]) == ["next", "dup", "urgency"]
    assert list(resp["answers"]["next"]) == ["type", "probabilities", "choice", "confidence"]
    assert list(resp["answers"]["dup"]) == ["type", "noul"]
    assert list(resp["answers"]["urgency"]) == ["type", "probabilities", "score", "legend", "confidence"]
    state = len(result.compiled.state.input_ids)
    suffixes = [len(b.suffix_ids) for q in result.compiled.questions for b in q.branches]
    assert resp["usage"] == {"input_tokens": state + sum(suffixes), "output_tokens": 0}
    assert resp["internal_usage"] == {"compute_tokens": sum(state + s for s in suffixes)}
    assert [lg.shape[0] for lg in result.logits] == [2, 2, 3]


def test_valen_run_cli(tiny_export, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(TEXT_REQUEST))
    ok = CliRunner().invoke(valen_run, ["--export", str(tiny_export["separate"]), "--device", "cpu", str(req)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["answers"]["next"]["choice"] in ("refund", "wait")
    stdin = CliRunner().invoke(valen_run, ["--export", str(tiny_export["separate"]), "--device", "cpu", "-"], input=json.dumps(TEXT_REQUEST))
    assert stdin.exit_code == 0 and json.loads(stdin.output) == json.loads(ok.output)


@pytest.mark.parametrize(
    "body,phrase",
    [
        ('{"model": "valen-preview-0923", "state": "  ", "questions": {"q": {"type": "noul", "instructions": "?"}}}', "state"),
        ('{"model": "other", "state": "x", "questions": {"q": {"type": "noul", "instructions": "?"}}}', "model"),
        ("not json", "JSON"),
    ],
)
def test_valen_run_bad_request_is_one_line_exit_2(tiny_export, tmp_path, body, phrase):
    req = tmp_path / "req.json"
    req.write_text(body)
    result = CliRunner().invoke(valen_run, ["--export", str(tiny_export["separate"]), "--device", "cpu", str(req)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("error:") and phrase in result.output


def test_valen_run_bad_export_is_one_line_exit_2(tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(TEXT_REQUEST))
    result = CliRunner().invoke(valen_run, ["--export", str(tmp_path / "missing"), "--device", "cpu", str(req)])
    assert result.exit_code == 2 and "not a directory" in result.output and "Traceback" not in result.output


def test_valen_run_refuses_cuda_graphs_on_the_cpu_in_one_line(tiny_export, tmp_path):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(TEXT_REQUEST))
    for flag, phrase in (("--cuda-graphs", "CUDA graphs"), ("--compile", "compile=True needs kernels='fast'")):
        args = ["--export", str(tiny_export["separate"]), "--device", "cpu", "--mode", "shared-prefix" if flag == "--cuda-graphs" else "per-branch", flag, str(req)]
        result = CliRunner().invoke(valen_run, args)
        assert result.exit_code == 2 and result.output.count("\n") == 1 and phrase in result.output, result.output


def test_an_engine_refuses_options_its_model_does_not_have(tiny_export):
    from valen_runtime.request import Compiler
    from valen_runtime.weights import load_model

    model = load_model(tiny_export["separate"], device="cpu", dtype="fp32")
    with pytest.raises(ValueError, match="options ask for bf16 on cpu, the model is torch.float32 on cpu"):
        Engine(model, Compiler.from_dir(tiny_export["separate"]), EngineOptions(device="cpu", dtype="bf16"))


def test_the_vision_tower_is_queued_from_inside_the_compile(tiny_export, long_image_request, long_video_request):
    """prepare() starts the tower once, from the compiler's on_images hook (before tokenization;
    for a video after the questions); its output is the tower run on the compiled request's
    images (video) afterwards, one feature row per image (video) token."""
    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32"))
    calls = []
    real = engine.vision_features
    engine.vision_features = lambda images: calls.append(images) or real(images)
    compiled, features = engine.prepare(long_image_request)
    assert len(calls) == 1
    assert torch.equal(features, real(compiled.state.image_inputs))
    assert engine.prepare(TEXT_REQUEST)[1] is None and len(calls) == 1  # a text state starts nothing
    compiled, features = engine.prepare(long_video_request)
    assert len(calls) == 2 and compiled.state.vision_inputs.grid_thw.tolist() == [[4, 4, 6]]
    assert torch.equal(features, real(compiled.state.video_inputs))
    assert features.shape[0] == compiled.state.mm_token_type_ids.count(2) == 4 * 6 and 1 not in compiled.state.mm_token_type_ids


def test_a_video_past_max_length_is_refused_before_any_frame_is_decoded(tiny_export, monkeypatch):
    """The token count of every branch is known from the probe and the plan: a clip whose prompt
    passes max_length is refused (422, naming the question) before pass 2 converts a frame and
    before the vision tower runs."""
    from valen_runtime import request as request_module
    from valen_runtime.errors import RequestError
    from valen_runtime.request import Compiler
    from valen_runtime.wire import http_status

    from .conftest import QUESTIONS, mp4_data_url

    base = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32"))
    request = {"model": "valen-preview-0923", "state": {"video": mp4_data_url(4, 96, 64)}, "questions": {"q": QUESTIONS["q"]}}
    length = len(base.compiler.compile(request).state.input_ids)
    short = Compiler(base.compiler.tokenizer, base.compiler.image_config, max_length=length + 5, video_config=base.compiler.video_config)
    engine = Engine(base.model, short, base.options)
    decoded, towers = [], []
    monkeypatch.setattr(request_module, "decode_frames", lambda *a, **k: decoded.append(a))
    engine.vision_features = lambda inputs: towers.append(inputs)
    with pytest.raises(RequestError) as info:
        engine.run(request)
    assert info.value.field == "questions.q" and "exceed max_length" in str(info.value) and http_status(info.value) == 422
    assert decoded == [] and towers == []


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def engine_fp32_bound(roundoff_bound, engine, request) -> float:
    """How far two fp32 computations of a request's logits may differ by rounding alone: the
    engine's own response to one stage's rounding of its input (the token embedding table),
    allowed once per layer and side (tests/conftest.py `fp32_roundoff_bound`)."""
    table = engine.model.text.embed_tokens.weight
    original = table.detach().clone()
    cfg = engine.model.config.text_config

    def logits(embeddings: torch.Tensor) -> torch.Tensor:
        table.data.copy_(embeddings)
        return torch.cat(engine.run(request).logits)

    try:
        return roundoff_bound(logits, original, max(cfg.hidden_size, cfg.intermediate_size), stages=cfg.num_hidden_layers)
    finally:
        table.data.copy_(original)


def test_shared_prefix_equals_per_branch_fp32_cpu(tiny_export, short_request, long_image_request, video_request, long_video_request,
                                                  roundoff_bound):
    """Exact in real arithmetic; fp32 rounding only (chunk boundaries and batching move)."""
    per_branch = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="per-branch"))
    shared_prefix = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix"))
    for request in (short_request, long_image_request, video_request, long_video_request):
        per, shared = per_branch.run(request), shared_prefix.run(request)
        assert max_diff(per.logits, shared.logits) <= engine_fp32_bound(roundoff_bound, per_branch, request)
        assert per.response["usage"] == shared.response["usage"]
    assert shared_prefix.plan(shared.compiled).shape.cut > 0  # a prefix phase ran


def test_an_image_state_under_one_chunk_runs_as_rows_fp32_cpu(tiny_export, short_request, roundoff_bound):
    """With a media minimum that leaves an image under 64 tokens, the rows layout scatters the
    image features into every row: shared-prefix (reference modules and fast layers) equals
    per-branch up to fp32 round-off."""
    from valen_runtime.request import Compiler

    from .conftest import png_data_url

    request = dict(short_request, state={"image": png_data_url(40, 24)})
    engines = {}
    for mode, kernels in (("per-branch", "torch"), ("shared-prefix", "torch"), ("shared-prefix", "fast")):
        base = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode=mode, kernels=kernels))
        small = Compiler(base.compiler.tokenizer, base.compiler.image_config, media_kwargs={"min_pixels": 1024, "max_pixels": 4096})
        engines[mode, kernels] = Engine(base.model, small, base.options)
    per_branch = engines["per-branch", "torch"]
    compiled = per_branch.compiler.compile(request)
    assert engines["shared-prefix", "fast"].plan(compiled).kind == "rows" and sum(compiled.state.mm_token_type_ids) > 0
    want = per_branch.run(request).logits
    bound = engine_fp32_bound(roundoff_bound, per_branch, request)
    for key in (("shared-prefix", "torch"), ("shared-prefix", "fast")):
        assert max_diff(want, engines[key].run(request).logits) <= bound, key


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fast_layouts_compute_the_reference_function_cpu(tiny_export, short_request, long_image_request, video_request, long_video_request,
                                                        dtype, roundoff_bound):
    """The fast engine (its one-pass layout, and its batch layout on the same plan) against the
    reference modules' shared-prefix engine and the per-branch engine. fp32: round-off only (the
    per-branch engine's own, engine_fp32_bound); bf16: within the shared-prefix bf16 gate's reach
    of per-branch (its logits move by up to ~0.1)."""
    options = dict(device="cpu", dtype=dtype)
    per_branch = Engine.load(tiny_export["separate"], EngineOptions(**options, mode="per-branch"))
    reference = Engine.load(tiny_export["separate"], EngineOptions(**options, mode="shared-prefix", kernels="torch"))
    fast = Engine.load(tiny_export["separate"], EngineOptions(**options, mode="shared-prefix", kernels="fast"))
    assert fast.kernels["layers"] == "fused, eager" and fast.one_pass
    for request in (short_request, long_image_request, video_request, long_video_request):
        base, want = per_branch.run(request), reference.run(request)
        got = fast.run(request)
        compiled, features = fast.prepare(request)
        batch = fast.execute_plan(compiled, plan_for(fast, compiled, one_pass=False), features)
        atol = engine_fp32_bound(roundoff_bound, per_branch, request) if dtype == "fp32" else 0.15
        for logits in (got.logits, batch):
            assert max_diff(logits, want.logits) <= atol and max_diff(logits, base.logits) <= atol, (dtype, logits, want.logits)
        assert got.response["usage"] == base.response["usage"]
    assert fast.plan(fast.compiler.compile(long_image_request)).kind == "one-pass"
    assert fast.plan(fast.compiler.compile(long_video_request)).kind == "one-pass"
    assert fast.plan(fast.compiler.compile(short_request)).kind == "rows"  # no chunk-aligned prefix to share
    assert fast.plan(fast.compiler.compile(video_request)).kind == "rows"


def plan_for(engine, compiled, one_pass: bool):
    from valen_runtime.layouts import choose

    return choose(compiled, engine.model.config, "one-pass" if one_pass else "batch")


def one_pass_accuracy(export, request, device: str, compile: bool) -> None:
    """The one-pass layout in bf16 must be about as accurate as the reference-shaped per-branch
    path in bf16, both measured against per-branch fp32 (two bf16 computations differ by their
    rounding, so neither is the yardstick for the other)."""
    truth = Engine.load(export, EngineOptions(device=device, dtype="fp32", mode="per-branch"))
    reference_shaped = Engine.load(export, EngineOptions(device=device, dtype="bf16", mode="per-branch"))
    one_pass = Engine.load(export, EngineOptions(device=device, dtype="bf16", mode="shared-prefix", kernels="fast", compile=compile))
    assert one_pass.plan(one_pass.compiler.compile(request)).kind == "one-pass"
    for _ in range(2):  # on CUDA the second run replays the captured graph
        got = torch.cat(one_pass.run(request).logits)
    want, base = torch.cat(truth.run(request).logits), torch.cat(reference_shaped.run(request).logits)
    err_ref, err_fast = (base - want).abs(), (got - want).abs()
    assert err_fast.mean() <= 1.5 * err_ref.mean() + 1e-2, (err_fast, err_ref)
    assert err_fast.max() <= 2 * err_ref.max() + 2e-2, (err_fast, err_ref)


def test_one_pass_is_as_accurate_as_per_branch_cpu(tiny_export, long_image_request):
    one_pass_accuracy(tiny_export["separate"], long_image_request, "cpu", compile=False)


def test_pad_rows_and_head_rows_change_real_logits_by_round_off_only_cpu(tiny_export, batch_requests, roundoff_bound):
    """The fast one-pass layout with shape buckets (pad sequences continuing the last request, pad
    head rows, longer token tables) against the same plan without them, alone and batched, fp32.
    Pads are rows no real row attends or reads, so only summation order may move: attention's
    kernels block the keys by sequence length (measured 1.4e-6 on a hidden state here), hence
    the round-off bound of engine_fp32_bound, not bit equality. Each request gets one extra
    question so the continuations and candidates are off the rungs."""
    from valen_runtime.layouts import one_pass

    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast"))
    assert engine.one_pass
    extra = {"extra": {"type": "noul", "instructions": "Was it charged " + "twice " * 5 + "?"}}
    requests = [dict(r, questions={**r["questions"], **extra}) for r in batch_requests]
    bounds = [engine_fp32_bound(roundoff_bound, engine, r) for r in requests]
    for group in ([0], [2], [0, 1, 2, 3], [1, 2]):
        prepared = [engine.prepare(requests[i]) for i in group]
        compiled, features = [c for c, _ in prepared], [f for _, f in prepared]
        padded = one_pass.build(compiled, engine.model.config)
        plain = one_pass.build(compiled, engine.model.config, buckets=False)
        assert padded.key != plain.key  # pads were added
        got = engine.execute_plan_many(compiled, padded, features)
        want = engine.execute_plan_many(compiled, plain, features)
        for i, a, b in zip(group, got, want):
            assert max_diff(a, b) <= bounds[i], (group, i, a, b)


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_one_pass_cpu(tiny_export, long_image_request, roundoff_bound):
    """The one-pass layout through torch.compile (inductor C++ here), fp32, against the reference
    modules' shared-prefix engine: fp32 round-off only."""
    options = dict(device="cpu", dtype="fp32", mode="shared-prefix")
    reference = Engine.load(tiny_export["separate"], EngineOptions(**options))
    compiled = Engine.load(tiny_export["separate"], EngineOptions(**options, kernels="fast", compile=True))
    assert compiled.plan(compiled.compiler.compile(long_image_request)).kind == "one-pass"
    bound = engine_fp32_bound(roundoff_bound, reference, long_image_request)  # inductor's C++ sums differ per CPU
    assert max_diff(reference.run(long_image_request).logits, compiled.run(long_image_request).logits) <= bound


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_batches_cpu(tiny_export, batch_requests, roundoff_bound):
    """Combined sweeps through torch.compile (inductor C++), fp32, in the compositions whose compiled
    variants differ (a mix; only requests without a prefix; several prefixes), each request against
    the reference modules' engine run alone: fp32 round-off only."""
    options = dict(device="cpu", dtype="fp32", mode="shared-prefix")
    reference = Engine.load(tiny_export["separate"], EngineOptions(**options))
    compiled = Engine.load(tiny_export["separate"], EngineOptions(**options, kernels="fast", compile=True))
    image, short, long_text, image_only = batch_requests
    for group in (batch_requests, [short, dict(short, state="Two charges, one order.")], [image, long_text], [long_text, image_only, image]):
        for request, got in zip(group, compiled.run_many(group)):
            bound = engine_fp32_bound(roundoff_bound, reference, request)
            assert got.timings["batch"] == len(group) and max_diff(reference.run(request).logits, got.logits) <= bound


def test_the_engine_on_graph_replay_semantics_answers_as_run_directly_cpu(tiny_export, batch_requests):
    """The engine's graph wiring (keys, the vision tower's tables, static buffers, the batch's
    copies of image features, pad logits dropped) under a CPU stand-in with CUDA-graph replay
    semantics: every run, direct, captured or replayed, alone or batched, gives the direct
    engine's logits bit for bit; two images of one grid in one batch keep their own features."""
    options = EngineOptions(device="cpu", dtype="bf16", mode="shared-prefix", kernels="fast")
    direct = Engine.load(tiny_export["separate"], options)
    graphed = Engine(direct.model, direct.compiler, options, fast=direct.fast)
    graphed.graphs = cpu_graphs()
    extra = {"extra": {"type": "noul", "instructions": "Was it charged twice?"}}
    for request in batch_requests + [dict(batch_requests[0], questions={**batch_requests[0]["questions"], **extra})]:
        want = direct.run(request).logits
        for _ in range(3):  # direct, capture, replay
            got = graphed.run(request).logits
            assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert graphed.graphs.captures > 0
    batched = direct.run_many(batch_requests)  # batch-mates change the GEMMs' row counts: compare batch with batch
    for _ in range(3):
        for got, want in zip(graphed.run_many(batch_requests), batched):
            assert got.timings["batch"] == len(batch_requests) and all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    same_grid = [dict(batch_requests[3], state={"image": solid_png_data_url(64, 48, colour)}) for colour in ("red", "navy")]
    want = direct.run_many(same_grid)
    for _ in range(3):
        got = graphed.run_many(same_grid)
        for g, w in zip(got, want):
            assert all(torch.equal(a, b) for a, b in zip(g.logits, w.logits))
    assert not all(torch.equal(a, b) for a, b in zip(got[0].logits, got[1].logits))


def test_an_image_size_is_captured_once_it_recurs_and_text_on_its_first_use_cpu(tiny_export, short_request, long_image_request):
    """Under graph replay semantics (CPU stand-in): a text request's plan is captured on its first
    use (padding lets its neighbours reuse it); an image request's vision tower and plan run directly
    the first time its image size is seen (a size seen once captures nothing and evicts nothing) and
    are captured the second time; a batch's combined plan is captured on its first use and replayed
    for the same requests in another order; every run answers as the direct engine does."""
    from valen_runtime.engine import vision_graph_key

    options = EngineOptions(device="cpu", dtype="bf16", mode="shared-prefix", kernels="fast")
    direct = Engine.load(tiny_export["separate"], options)
    graphed = Engine(direct.model, direct.compiler, options, fast=direct.fast)
    graphed.graphs = cpu_graphs()
    want = direct.run(short_request).logits
    assert all(torch.equal(a, b) for a, b in zip(want, graphed.run(short_request).logits))
    text_keys = list(graphed.graphs.keys())
    assert len(text_keys) == 1 and graphed.graphs.captures == 1  # captured on the first use
    vision_key = vision_graph_key(graphed.compiler.compile(long_image_request).state.image_grid_thw)
    want = direct.run(long_image_request).logits
    got = graphed.run(long_image_request).logits  # the image size's first use: direct runs
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert list(graphed.graphs.keys()) == text_keys and graphed.graphs.captures == 1
    for _ in range(2):  # its second use captures the tower and the plan, the third replays
        got = graphed.run(long_image_request).logits
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert vision_key in graphed.graphs and len(graphed.graphs) == 3 and graphed.graphs.captures == 3
    pair = [short_request, dict(short_request, state="A second and different account of the same order.")]
    for batch, how in ((pair, "capture"), (pair[::-1], "replay"), (pair, "replay")):  # a batch's combined plan: captured on its first use, replayed in any order
        want = direct.run_many(batch)
        got = graphed.run_many(batch)
        assert graphed.graphs.captures == 4 and all(r.timings["batch"] == 2 and r.timings["graph"] == how for r in got)
        assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g.logits, w.logits))


def test_while_warming_up_every_first_use_is_captured_cpu(tiny_export, short_request, long_image_request):
    """Inside `Engine.warming_up()` (a server's warmup) an image size's tower and plan, and a
    batch's combined plan, are captured on their first use, so a client's first request of the
    warmup's shapes replays; outside it the usual policy holds again (a new image size runs
    directly first). Every run answers as the direct engine does."""
    from valen_runtime.engine import vision_graph_key

    options = EngineOptions(device="cpu", dtype="bf16", mode="shared-prefix", kernels="fast")
    direct = Engine.load(tiny_export["separate"], options)
    graphed = Engine(direct.model, direct.compiler, options, fast=direct.fast)
    graphed.graphs = cpu_graphs()
    pair = [short_request, dict(short_request, state="A second and different account of the same order.")]
    want_image, want_pair = direct.run(long_image_request).logits, direct.run_many(pair)
    with graphed.warming_up():
        graphed.run(long_image_request)
        graphed.run_many(pair)
    vision_key = vision_graph_key(graphed.compiler.compile(long_image_request).state.image_grid_thw)
    assert vision_key in graphed.graphs and graphed.graphs.captures == 3  # tower, image plan, the pair's plan
    got = graphed.run(long_image_request).logits  # the client's first: replayed
    assert graphed.graphs.captures == 3 and all(torch.equal(a, b) for a, b in zip(want_image, got))
    got = graphed.run_many(pair)
    assert graphed.graphs.captures == 3
    assert all(torch.equal(a, b) for g, w in zip(got, want_pair) for a, b in zip(g.logits, w.logits))
    other_size = dict(long_image_request, state={"image": png_data_url(160, 96)})
    assert vision_graph_key(graphed.compiler.compile(other_size).state.image_grid_thw) not in graphed.graphs
    graphed.run(other_size)  # after the warmup, a new image size's first use runs directly
    assert graphed.graphs.captures == 3 and not graphed.graphs.every_first_use


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("states", ["text and image", "video"])
def test_cuda_paths_agree_with_per_branch(tiny_export, short_request, long_image_request, states, request):
    """On CUDA: per-branch (the reference modules) vs shared-prefix on the reference modules / the
    fast path / the fast path replayed from CUDA graphs, fp32 and bf16. A video state (frame
    pairs on the tower, a shared prefix) runs the CUDA default only (bf16, fast, compiled,
    graphs; the batch layout, fp32's on CUDA, meets it in fast/test_model.py): the other paths
    meet nothing a video changes that the image does not, and the gpu-marked tests share one
    call's minutes."""
    tolerances = (("fp32", 1e-3), ("bf16", 0.15))
    if states == "video":
        pytest.importorskip("av")
        wires, configs, tolerances = (request.getfixturevalue("long_video_request"),), (("fast", True),), tolerances[1:]
    else:
        wires, configs = (short_request, long_image_request), (("torch", False), ("fast", False), ("fast", True))
    for dtype, atol in tolerances:
        per_branch = Engine.load(tiny_export["separate"], EngineOptions(device="cuda", dtype=dtype, mode="per-branch"))
        bases = [per_branch.run(r) for r in wires]
        for kernels, graphs in configs:
            eng = Engine.load(tiny_export["separate"], EngineOptions(device="cuda", dtype=dtype, mode="shared-prefix", kernels=kernels, graphs=graphs))
            assert eng.options.compile == (kernels == "fast")
            for wire, base in zip(wires, bases):
                for _ in range(3):  # graphs: capture, then replays
                    res = eng.run(wire)
                # fp32: FLA/SDPA/fused layers reorder sums (TF32 off); bf16: per-branch vs
                # shared-prefix chunking and the fast layers' rounding
                assert max_diff(base.logits, res.logits) <= atol, (dtype, kernels, graphs, base.logits, res.logits)


@gpu
def test_compiled_one_pass_is_as_accurate_as_per_branch_cuda(tiny_export, long_image_request):
    # The default layout passes no cache between compiled calls; whether that keeps it clear of the
    # compiled-continuation loss (tests/valen_runtime/fast/test_model.py) had not been measured
    # directly (docs/parity.md).
    one_pass_accuracy(tiny_export["separate"], long_image_request, "cuda", compile=True)


@gpu
def test_graph_replay_is_bitwise_equal_to_direct_execution(tiny_export, short_request, long_image_request, request):
    """Requests' forwards and their vision towers, an image's and a video's (t > 1 frame pairs:
    a grid key of its own), captured and replayed compute the bits of a direct run of the plan the
    graph runs (`layouts.graph_plan`: the request padded into a captured shape, or with headroom)."""
    from valen_runtime.layouts import graph_plan
    from valen_runtime.vision import grid_list

    pytest.importorskip("av", reason="PyAV decodes the video request")
    video_request = request.getfixturevalue("video_request")
    options = dict(device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast")
    direct = Engine.load(tiny_export["separate"], EngineOptions(**options, graphs=False))
    graphed = Engine.load(tiny_export["separate"], EngineOptions(**options, graphs=True))
    requests = (short_request, long_image_request, video_request)
    served_keys = set()
    for wire in requests:
        compiled, features = direct.prepare(wire)
        served = graph_plan([compiled], direct.model.config, direct.plan(compiled), graphed.graphs.keys())
        want = [logits.cpu() for logits in direct.execute_plan(compiled, served, features)]
        served_keys.add(served.key)
        for _ in range(3):  # capture, then replays
            got = graphed.run(wire).logits  # host tensors
            assert len(got) == len(want)
            for a, b in zip(want, got):
                assert torch.equal(a, b)
    compiled = [graphed.compiler.compile(r) for r in requests]
    video_grid = grid_list(compiled[2].state.video_grid_thw)
    assert video_grid[0][0] > 1  # several frame pairs in one tower call
    # the three forwards (distinct keys unless one's graph holds another) and the two towers
    towers = {("vision", tuple(grid_list(compiled[1].state.image_grid_thw))), ("vision", tuple(video_grid))}
    assert set(graphed.graphs.graphs) == served_keys | towers
    video_inputs = compiled[2].state.vision_inputs
    assert torch.equal(graphed.vision_features(video_inputs), direct.vision_features(video_inputs))  # a replay of its graph
    captured = len(graphed.graphs)
    for wire in requests:
        graphed.run(wire)
    assert len(graphed.graphs) == captured  # the same shapes replay, nothing new is captured


def with_longer_question(request: dict, words: int) -> dict:
    """`request` with its first question's instructions `words` words longer."""
    questions = {k: dict(v) for k, v in request["questions"].items()}
    first = next(iter(questions))
    questions[first]["instructions"] += " please" * words
    return dict(request, questions=questions)


@gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "batched"])
def test_layouts_of_one_graph_key_replay_bitwise_as_run_directly(tiny_export, batch_requests, grouped):
    """Shape buckets: two requests (or batches) whose questions differ in length fall on one graph
    key; the graph captured for the first, replayed with the second's inputs (other sequence
    lengths, head rows, tokens), computes the bits the compiled layers compute when they run the
    plan it serves (`graph_plan`) directly. This is what holds if no host-side value (a sequence
    length, a launch grid) is baked into the graph beyond `Plan.key`."""
    from valen_runtime.fast.kernels import fla_available
    from valen_runtime.layouts import graph_plan, one_pass

    if not fla_available():
        pytest.skip("flash-linear-attention not importable: CUDA runs the batch layout")
    export = tiny_export["separate"]
    graphed = Engine.load(export, EngineOptions(device="cuda", dtype="bf16"))
    direct = Engine.load(export, EngineOptions(device="cuda", dtype="bf16", graphs=False))
    base = batch_requests if grouped else [batch_requests[0]]
    by_key: dict = {}
    for words in range(0, 60):
        group = [with_longer_question(r, words) for r in base]
        compiled = [graphed.compiler.compile(r) for r in group]
        plan = one_pass.build(compiled, graphed.model.config)
        lengths = tuple(plan.inputs.layout.cu_seqlens.tolist())  # the real layout
        by_key.setdefault(plan.key, {}).setdefault(lengths, group)
    first, second = next(groups for groups in map(list, (v.values() for v in by_key.values())) if len(groups) > 1)[:2]
    run = (lambda e, g: e.run_many(g)) if grouped else (lambda e, g: [e.run(g[0])])
    run(graphed, first)  # text: captured on this first use; with an image: direct until its size recurs
    run(graphed, first)  # captured by now
    captured = list(graphed.graphs.keys())
    # The plan the second's replay runs (graph_plan: padded into the first's captured shape), run directly
    prepared = direct.prepare_many(second)
    compiled, features = [c for c, _ in prepared.ready], [f for _, f in prepared.ready]
    served = graph_plan(compiled, direct.model.config, prepared.plan if grouped else direct.plan(compiled[0]), captured)
    assert served.key in captured
    want = direct.execute_plan_many(compiled, served, features)
    got = run(graphed, second)  # replays the first's graph
    assert set(graphed.graphs.keys()) == set(captured) and list(graphed.graphs.keys())[-1] == served.key  # nothing new
    assert all(r.timings.get("batch", 1) == len(first) for r in got)
    for result, logits in zip(got, want):
        assert all(torch.equal(x, y.cpu()) for x, y in zip(result.logits, logits)), (result.logits, logits)


@gpu
def test_batched_one_pass_on_cuda_is_as_accurate_as_each_alone(tiny_export, batch_requests, assert_truth_relative):
    """The CUDA default (bf16, compiled, CUDA graphs, FLA's varlen rule) sweeping four different
    requests together: every answer within the parity gate's truth-relative bound of per-branch
    fp32, as each request run alone is; replaying the combined graph is bitwise the captured run."""
    from valen_runtime.fast.kernels import fla_available

    if not fla_available():
        pytest.skip("flash-linear-attention not importable: CUDA runs the batch layout, which does not batch requests")
    export = tiny_export["separate"]
    fast = Engine.load(export, EngineOptions(device="cuda", dtype="bf16"))
    assert fast.batches and fast.graphs is not None and fast.fast.compiled and fast.kernels["gated_delta"].startswith("fla")
    runs = [fast.run_many(batch_requests) for _ in range(3)]  # direct, capture, replay
    assert all(r.timings["batch"] == len(batch_requests) for r in runs[-1])
    for a, b in zip(runs[1], runs[2]):
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    alone = [fast.run(r) for r in batch_requests]
    truth = Engine.load(export, EngineOptions(device="cuda", dtype="fp32", mode="per-branch"))
    reference = Engine.load(export, EngineOptions(device="cuda", dtype="bf16", mode="per-branch"))
    assert_truth_relative([r.response for r in runs[-1]], truth, reference, batch_requests, "cuda")
    assert_truth_relative([r.response for r in alone], truth, reference, batch_requests, "cuda")
    # Two different images of one grid: the graphed tower answers in one buffer, which each request
    # of a batch must have copied before the next image replays it.
    same_grid = [dict(batch_requests[3], state={"image": solid_png_data_url(64, 48, colour)}) for colour in ("red", "navy")]
    together = fast.run_many(same_grid)
    assert together[0].response["answers"] != together[1].response["answers"]
    assert_truth_relative([r.response for r in together], truth, reference, same_grid, "cuda")


def solid_png_data_url(width: int, height: int, colour: str) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.parametrize("device, phrase", [
    ("tpu", "is not cpu, cuda or cuda:N"),
    ("nonsense:x", "is not cpu, cuda or cuda:N"),
    pytest.param("cuda", "CUDA is not available", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_valen_run_bad_device_is_one_line_exit_2(tiny_export, tmp_path, device, phrase):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(TEXT_REQUEST))
    result = CliRunner().invoke(valen_run, ["--export", str(tiny_export["separate"]), "--device", device, str(req)])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("error:") and phrase in result.output, result.output


def _independent_logits(engine, compiled) -> list[torch.Tensor]:
    """Per-branch logits of a text-only request from the model's modules, without the engine:
    one full forward of state + suffix from position 0, the head on the candidate and decision rows."""
    model = engine.model
    out = []
    for question in compiled.questions:
        rows = []
        for branch in question.branches:
            ids = torch.tensor([compiled.state.input_ids + branch.suffix_ids])
            positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)  # text only: the three axes agree
            with torch.no_grad():
                hidden = model.text(model.text.embed(ids), positions)[0]
                rows.append(model.head.logits(hidden[list(branch.candidate_positions)], hidden[branch.decision_position]))
        out.append(torch.cat(rows))
    return out


def _independent_answer(kind: str, keys: list[str], logits: torch.Tensor) -> dict:
    """Valen's answer (docs/valen-model.md) written out here: fp32 softmax, float64 renormalised,
    first maximum, confidence and score formulas."""
    values = logits.float().softmax(-1).tolist()
    total = 0.0
    for v in values:
        total += v
    p = [v / total for v in values]
    k = len(p)
    mode = max(range(k), key=lambda i: (p[i], -i))
    if kind == "noul":
        return {"noul": p[keys.index("true")]}
    answer = {"probabilities": dict(zip(keys, p))}
    if kind == "choice":
        answer["choice"] = keys[mode]
        answer["confidence"] = 1.0 if k == 1 else max(0.0, (p[mode] - 1 / k) / (1 - 1 / k))
    else:
        answer["score"] = sum(i * v for i, v in enumerate(p))
        mad = sum(abs(i - (k - 1) / 2) for i in range(k)) / k
        answer["confidence"] = max(0.0, 1 - sum(v * abs(i - mode) for i, v in enumerate(p)) / mad)
    return answer


@pytest.mark.parametrize("lora, dtype", [("separate", "fp32"), ("merged", "bf16")])
def test_run_answers_match_an_independent_computation(tiny_export, lora, dtype):
    engine = Engine.load(tiny_export[lora], EngineOptions(device="cpu", dtype=dtype, mode="per-branch"))
    request = dict(TEXT_REQUEST, questions=dict(TEXT_REQUEST["questions"], four={
        "type": "choice", "instructions": "Which team?", "criteria": {"billing": "Billing", "support": "Support", "sales": None, "legal": "Legal"}}))
    result = engine.run(request)
    logits = _independent_logits(engine, result.compiled)
    for question, got, want in zip(result.compiled.questions, result.logits, logits):
        assert torch.equal(got, want.float())  # per-branch: the same ops in the same order
        expected = _independent_answer(question.kind, list(question.keys), want)
        answer = result.response["answers"][question.qid]
        if question.kind == "noul":
            assert answer["noul"] == pytest.approx(expected["noul"], abs=1e-15)
            continue
        assert list(answer["probabilities"]) == list(question.keys)
        for key in question.keys:
            assert answer["probabilities"][key] == pytest.approx(expected["probabilities"][key], abs=1e-15), (question.qid, key)
        for field in ("choice", "score", "confidence"):
            if field in expected:
                assert answer[field] == pytest.approx(expected[field], abs=1e-15), (question.qid, field)


# ---- several requests in one sweep (run_many)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_batched_requests_answer_as_each_alone_cpu(tiny_export, batch_requests, long_video_request, dtype, roundoff_bound,
                                                   assert_truth_relative):
    """run_many sweeps six different requests (image + long text, short text, long text, image
    alone, video + long text, another short text: the two short ones share an attention group)
    through the layers together; each one's logits are its own function, so they match
    the request run alone up to rounding: fp32 within the per-branch engine's own round-off at that
    request (engine_fp32_bound), bf16 (GEMM shapes change with the batch) within the parity gate's
    truth-relative bound of per-branch fp32, like the request alone."""
    export = tiny_export["separate"]
    short = dict(batch_requests[1], state="Another customer writes: the parcel came open.")
    batch_requests = batch_requests + [long_video_request, short]
    fast = Engine.load(export, EngineOptions(device="cpu", dtype=dtype, mode="shared-prefix", kernels="fast"))
    assert fast.batches and fast.prepare_many(batch_requests).plan.shape.prefixes.count(0) == 1
    batched = fast.run_many(batch_requests)
    assert [r.timings["batch"] for r in batched] == [len(batch_requests)] * len(batch_requests)
    alone = [fast.run(r) for r in batch_requests]
    for got, want in zip(batched, alone):
        assert got.response["usage"] == want.response["usage"] and list(got.response["answers"]) == list(want.response["answers"])
    if dtype == "fp32":
        per_branch = Engine.load(export, EngineOptions(device="cpu", dtype="fp32", mode="per-branch"))
        for request, got, want in zip(batch_requests, batched, alone):
            assert max_diff(got.logits, want.logits) <= engine_fp32_bound(roundoff_bound, per_branch, request)
        return
    truth = Engine.load(export, EngineOptions(device="cpu", dtype="fp32", mode="per-branch"))
    reference = Engine.load(export, EngineOptions(device="cpu", dtype="bf16", mode="per-branch"))
    assert_truth_relative([r.response for r in batched], truth, reference, batch_requests, "cpu")


def test_run_many_of_one_request_is_run(tiny_export, long_image_request, short_request, long_video_request):
    """m = 1 is the single-request path: bitwise the same logits, whatever the layout."""
    fast = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="bf16", mode="shared-prefix", kernels="fast"))
    for request in (long_image_request, short_request, long_video_request):
        (got,) = fast.run_many([request])
        want = fast.run(request)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits)) and got.response == want.response


def test_prepare_many_calls_between_before_each_request_and_the_plan(tiny_export, batch_requests):
    """valen-serve's hook into a batch's host work (it answers the batch in flight there): called
    before each request and once before the plan; on the CPU a launched batch is done at once."""
    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast"))
    seen: list[str] = []
    prepare, fitted = engine.prepare, engine.served_plan
    engine.prepare = lambda request: (seen.append("request"), prepare(request))[1]
    engine.served_plan = lambda *args: (seen.append("plan"), fitted(*args))[1]
    started = time.perf_counter()
    batch = engine.prepare_many(batch_requests, between=lambda: (seen.append("between"), time.sleep(0.05)))
    wall = time.perf_counter() - started
    assert seen == ["between", "request"] * len(batch_requests) + ["between", "plan"]
    # the hook's time (another batch's work) is not this batch's prepare_s: at least 0.05 s per call
    assert 0 < batch.timings["prepare_s"] <= wall - 0.05 * (len(batch_requests) + 1)
    launched = engine.launch(batch)
    assert launched.done is None and engine.device_done(launched)
    for got, want in zip(engine.collect(launched), engine.run_many(batch_requests)):
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


@gpu
def test_a_launched_batch_is_done_once_its_event_is_and_collects_as_run_many(tiny_export, batch_requests):
    """On CUDA launch records an event after the batch's device work and the copy of its outputs:
    device_done is that event's state (true once it completed), collecting waits for nothing
    queued later and gives run_many's logits and responses bit for bit."""
    # eager fast kernels: what is tested is the event, not the compiled or graphed sweep
    options = EngineOptions(device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast", compile=False, graphs=False)
    engine = Engine.load(tiny_export["separate"], options)
    want = engine.run_many(batch_requests)
    launched = engine.launch(engine.prepare_many(batch_requests))
    assert isinstance(launched.done, torch.cuda.Event)
    launched.done.synchronize()
    assert engine.device_done(launched)
    # Work queued after the launch (valen-serve: the next batch's towers) does not hold the collect
    # up: its outputs were copied to the host behind the batch's own work. ~1-3 s of spinning.
    torch.cuda._sleep(4_000_000_000)
    results = engine.collect(launched)
    assert not torch.cuda.current_stream().query(), "collect waited for work queued after the launch"
    torch.cuda.synchronize()
    for got, expected in zip(results, want):
        assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits)) and got.response == expected.response


@gpu
def test_collect_reads_the_host_copy_only_after_the_copy(tiny_export, batch_requests):
    """With the device held between a batch's model and the copy of its outputs, the batch is not
    done and collect waits for the copy: it answers as run_many does, not from whatever the pinned
    buffer held (a batch in the reverse order ran just before, so a stale buffer reads wrong)."""
    options = EngineOptions(device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast", compile=False, graphs=False)
    engine = Engine.load(tiny_export["separate"], options)
    want = engine.run_many(batch_requests)
    engine.run_many(batch_requests[::-1])  # its freed pinned block, of the same size, holds other values in each place
    queue_outputs = engine.queue_outputs

    def held(compiled, logits):  # ~0.3-1 s of spinning per request between the model and the softmaxes and copy
        torch.cuda._sleep(1_000_000_000)
        return queue_outputs(compiled, logits)

    engine.queue_outputs = held
    launched = engine.launch(engine.prepare_many(batch_requests))
    assert not engine.device_done(launched)
    for got, expected in zip(engine.collect(launched), want):
        assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits)) and got.response == expected.response


def test_a_request_whose_logits_are_not_finite_fails_alone_in_a_batch(tiny_export, batch_requests):
    """Finishing a batch answers each request on its own: one whose logits came out NaN gets its
    ValueError, its batch-mates their answers as run_many alone gives them."""
    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast"))
    want = engine.run_many(batch_requests)
    queue_outputs, calls = engine.queue_outputs, []

    def second_poisoned(compiled, logits):  # called per request in batch order
        calls.append(compiled)
        return queue_outputs(compiled, [lg * float("nan") for lg in logits] if len(calls) == 2 else logits)

    engine.queue_outputs = second_poisoned
    got = engine.run_many(batch_requests)
    assert len(calls) == len(batch_requests)
    assert isinstance(got[1], ValueError) and "finite" in str(got[1])
    for g, w in ((got[0], want[0]), (got[2], want[2]), (got[3], want[3])):
        assert g.response == w.response and all(torch.equal(a, b) for a, b in zip(g.logits, w.logits))


def test_a_batch_of_bad_requests_answers_each_with_its_own_error(tiny_export, batch_requests):
    from valen_runtime.errors import RequestError

    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast"))
    bad = [dict(batch_requests[0], state="  "), dict(batch_requests[1], questions={})]
    launched = engine.launch(engine.prepare_many(bad))
    assert launched.error is None and launched.outputs == []
    results = engine.collect(launched)
    assert all(isinstance(r, RequestError) for r in results) and "state" in str(results[0]) and "questions" in str(results[1])


def test_a_bad_request_fails_alone_in_a_batch(tiny_export, batch_requests):
    """A request that does not compile comes back as its own RequestError; its batch-mates are
    answered as a batch without it."""
    from valen_runtime.errors import RequestError

    fast = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast"))
    bad = dict(batch_requests[1], state="  ")
    results = fast.run_many([batch_requests[0], bad, batch_requests[2]])
    assert isinstance(results[1], RequestError) and "state" in str(results[1])
    assert [r.timings["batch"] for r in (results[0], results[2])] == [2, 2]
    for request, got in zip((batch_requests[0], batch_requests[2]), (results[0], results[2])):
        assert got.response["usage"] == fast.run(request).response["usage"]


def test_the_reference_engines_run_a_batch_one_by_one(tiny_export, batch_requests):
    """Where the engine does not batch (per-branch, or the reference modules), run_many is run per request: bitwise."""
    for mode, kernels in (("per-branch", "torch"), ("shared-prefix", "torch")):
        engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode=mode, kernels=kernels))
        assert not engine.batches
        for request, got in zip(batch_requests[:2], engine.run_many(batch_requests[:2])):
            assert all(torch.equal(a, b) for a, b in zip(got.logits, engine.run(request).logits))


def test_valen_run_refuses_a_flipped_byte_unless_told_to_check_sizes_only(tiny_export, tmp_path):
    """A damaged file of the same size is refused by default, as valen-serve and valen-verify refuse it."""
    export = Path(shutil.copytree(tiny_export["separate"], tmp_path / "export"))
    head = export / "valen_head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: the file still parses, one value changes
    head.write_bytes(bytes(data))
    req = tmp_path / "req.json"
    req.write_text(json.dumps(TEXT_REQUEST))
    refused = CliRunner().invoke(valen_run, ["--export", str(export), "--device", "cpu", str(req)])
    assert refused.exit_code == 2, refused.output
    assert refused.output.count("\n") == 1 and "valen_head.safetensors: sha256" in refused.output and "does not match the manifest's" in refused.output
    opted_out = CliRunner().invoke(valen_run, ["--export", str(export), "--device", "cpu", "--verify", "size", str(req)])
    assert opted_out.exit_code == 0 and json.loads(opted_out.output)["answers"]


@pytest.fixture(scope="module")
def reference_fp32(tiny_fixture):
    """(model, processor): the reference's own model in fp32, built once for the module."""
    from parity.reference import build_reference

    model, _, processor = build_reference(tiny_fixture.checkpoint, tiny_fixture.base, dtype="fp32")
    return model, processor


@pytest.mark.parametrize("state", ["long_image_request", "long_video_request"])
def test_per_branch_hidden_states_equal_transformers_own_model_fp32(reference_fp32, tiny_export, state, request, tmp_path):
    """The whole per-branch path of an image or a video state (ids, pixels, vision tower, the
    features scattered into the pad tokens, M-RoPE, the text stack with its LoRA) against the
    reference's own model (transformers 5.4.0 + PEFT, parity/reference.py) in fp32, fed by the
    pinned processor: for a video, the frames and video_metadata torchvision 0.21's read_video gives."""
    import base64
    import io

    from PIL import Image

    from .test_video import read_video_pinned

    payload = request.getfixturevalue(state)
    model, processor = reference_fp32
    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="per-branch"))
    compiled, features = engine.prepare(payload)
    media, text_item = payload["state"]["messages"][0]["content"]
    url = media["image"] if media["type"] == "image" else media["video_url"]["url"]
    data = base64.b64decode(url.split(",", 1)[1])
    kind = "image" if media["type"] == "image" else "video"
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": kind}, text_item]}], tokenize=False, add_generation_prompt=False)
    if kind == "image":
        inputs = processor(text=[prompt], images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    else:
        frames, fps = read_video_pinned(data, "mp4", tmp_path)
        inputs = processor(text=[prompt], videos=[frames], video_metadata=[{"total_num_frames": len(frames), "fps": fps}], return_tensors="pt")
    st = compiled.state
    assert st.input_ids == inputs["input_ids"][0].tolist() and st.mm_token_type_ids == inputs["mm_token_type_ids"][0].tolist()
    pixels = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw") if k in inputs}
    branch = compiled.questions[0].branches[0]
    ids = st.input_ids + branch.suffix_ids
    types = st.mm_token_type_ids + [0] * len(branch.suffix_ids)
    with torch.no_grad():
        model.backbone.rope_deltas = None
        want = model.backbone(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]), **pixels,
                              use_cache=False, return_dict=True).last_hidden_state[0]
        got = engine.branch_hidden(compiled, branch, features)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale, ((got - want).abs().max().item(), scale)
