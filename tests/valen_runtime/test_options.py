"""valen_runtime.options.EngineOptions: the defaults per device, every refusal in one line, and
each option reaching the computation it names (a mutation that drops one fails a test here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from valen_runtime.fast.kernels import fla_available
from valen_runtime.options import EngineOptions

REFERENCE_CHOICES = {"layout": "batch", "delta_kernel": "torch", "patch_embed": "conv", "batching": False, "temperature": 1.0, "calibration": None}


def test_cpu_defaults_are_the_reference_shape():
    assert EngineOptions(device="cpu").to_json() == {
        "device": "cpu", "dtype": "bf16", "mode": "per-branch", "kernels": "torch", "graphs": False, "compile": False, **REFERENCE_CHOICES,
    }
    # the CPU's fast path: the one-pass layout (what CUDA runs by default), batching, the GEMM patch embed
    fast = EngineOptions(device="cpu", mode="shared-prefix", kernels="fast")
    assert (fast.layout, fast.delta_kernel, fast.patch_embed, fast.batching) == ("one-pass", "torch", "linear", True)


def test_cuda_defaults_are_the_compiled_graphed_fast_path():
    # Resolving needs no GPU: the device name decides the defaults, and whether FLA imports the delta rule.
    fla = fla_available()
    assert EngineOptions(device="cuda").to_json() == {
        "device": "cuda", "dtype": "bf16", "mode": "shared-prefix", "kernels": "fast", "graphs": True, "compile": True,
        "layout": "one-pass" if fla else "batch", "delta_kernel": "fla" if fla else "torch", "patch_embed": "linear", "batching": fla,
        "temperature": 1.0, "calibration": None,
    }
    assert EngineOptions(device="cuda:1", mode="per-branch").to_json() == {
        "device": "cuda:1", "dtype": "bf16", "mode": "per-branch", "kernels": "torch", "graphs": False, "compile": False, **REFERENCE_CHOICES,
    }
    fp32 = EngineOptions(device="cuda", dtype="fp32")  # FLA's products are TF32 in fp32: the reference rule, the batch layout
    assert (fp32.delta_kernel, fp32.layout, fp32.batching) == ("torch", "batch", False)
    assert EngineOptions(device="cuda", kernels="torch").compile is False  # nothing to compile on the reference modules


def test_no_device_means_cuda_when_available():
    assert EngineOptions().device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_explicit_choices_are_kept():
    opts = EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast", compile=True)
    assert (opts.dtype, opts.mode, opts.kernels, opts.graphs, opts.compile) == ("fp32", "shared-prefix", "fast", False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.mode = "per-branch"


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (dict(device="mps"), "device 'mps' is not cpu, cuda or cuda:N"),
        (dict(device="cuda:x"), "device 'cuda:x'"),
        (dict(device="cpu", dtype="fp16"), "dtype 'fp16' is not one of bf16, fp32"),
        (dict(device="cpu", mode="batched"), "mode 'batched' is not one of per-branch, shared-prefix"),
        (dict(device="cpu", kernels="triton"), "kernels 'triton' is not one of torch, fast"),
        (dict(device="cpu", mode="shared-prefix", graphs=True), "CUDA graphs need mode='shared-prefix' on a CUDA device"),
        (dict(device="cuda", mode="per-branch", graphs=True), "CUDA graphs need"),
        (dict(device="cuda", kernels="fast", compile=False, graphs=True), "CUDA graphs of the fast path need compile=True"),
        (dict(device="cpu", compile=True), "compile=True needs kernels='fast'"),
        (dict(device="cpu", layout="rows"), "layout 'rows' is not one of one-pass, batch"),
        (dict(device="cpu", mode="shared-prefix", layout="one-pass"), "layout='one-pass' needs kernels='fast'"),
        (dict(device="cpu", kernels="fast", delta_kernel="fla"), "delta_kernel='fla' needs kernels='fast', bf16 and CUDA"),
        (dict(device="cpu", kernels="fast", delta_kernel="triton"), "delta_kernel 'triton' is not one of torch, fla"),
        (dict(device="cpu", patch_embed="linear"), "patch_embed='linear' needs kernels='fast'"),
        (dict(device="cpu", patch_embed="gemm"), "patch_embed 'gemm' is not one of linear, conv"),
        (dict(device="cpu", kernels="fast", batching=True), "batching=True needs mode='shared-prefix' and layout='one-pass'"),
        (dict(device="cpu", mode="shared-prefix", kernels="fast", layout="batch", batching=True), "batching=True needs"),
        (dict(device="cpu", temperature=0.0), "temperature must be a finite number > 0"),
        (dict(device="cpu", temperature=float("nan")), "temperature must be a finite number > 0"),
        (dict(device="cpu", temperature=True), "temperature must be a finite number > 0"),
        (dict(device="cpu", temperature=0.5, calibration="calibration.json"), "temperature and calibration are mutually exclusive"),
    ],
)
def test_impossible_combinations_are_refused_in_one_line(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase.replace("(", r"\(").replace(")", r"\)")) as e:
        EngineOptions(**kwargs)
    assert "\n" not in str(e.value)


def test_describe_states_every_resolved_choice(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text('{"temperature": 0.8}')
    opts = EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast", calibration=str(calibration))
    assert opts.temperature == 0.8 and opts.calibration is None  # read once: its temperature stands for it
    assert opts.describe() == {
        "device": "cpu", "dtype": "fp32", "mode": "shared-prefix", "kernels": "fast", "graphs": False, "compile": False,
        "layout": "one-pass", "delta_kernel": "torch", "patch_embed": "linear", "batching": True, "temperature": 0.8,
    }
    assert opts.summary() == ("device=cpu dtype=fp32 mode=shared-prefix kernels=fast graphs=false compile=false layout=one-pass "
                              "delta_kernel=torch patch_embed=linear batching=true temperature=0.8")
    # resolved options given back resolve to themselves (dataclasses.replace re-runs the checks)
    assert dataclasses.replace(opts) == opts and dataclasses.replace(opts, dtype="bf16").temperature == 0.8


def test_a_bad_calibration_file_is_one_line(tmp_path):
    from valen_runtime.errors import ConfigError

    bad = tmp_path / "calibration.json"
    bad.write_text('{"temp": 1.0}')
    with pytest.raises(ConfigError, match="calibration.json: expected an object with a 'temperature' field"):
        EngineOptions(device="cpu", calibration=str(bad))


# ---- each option reaches the computation (CPU; graphs are covered by the gpu-marked engine tests)


@pytest.fixture(scope="module")
def fp32_engine(tiny_export):
    from valen_runtime.engine import Engine

    return Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32"))


def expected_probabilities(logits: torch.Tensor, temperature: float) -> list[float]:
    """softmax(logits / T) in float64 from the plain formula, independent of answers.py."""
    import math

    values = [float(v) / temperature for v in logits.tolist()]
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def stated_probabilities(response: dict, question) -> list[float]:
    answer = response["answers"][question.qid]
    return [answer["noul"], 1 - answer["noul"]] if "noul" in answer else [answer["probabilities"][k] for k in question.keys]


@pytest.mark.parametrize("how", ["option", "calibration", "engine argument"])
def test_the_temperature_divides_the_logits_before_the_softmax(tiny_export, fp32_engine, tmp_path, how):
    from valen_runtime.engine import Engine

    request = {"model": "valen-preview-0923", "state": "The card was charged twice for one order.",
               "questions": {"q": {"type": "choice", "instructions": "What next?", "criteria": {"a": "Refund", "b": "Wait", "c": "Escalate"}},
                             "n": {"type": "noul", "instructions": "Is it a duplicate?"}}}
    T = 0.05  # the tiny model's logits are small: a low temperature moves its probabilities far from T = 1's
    calibration = tmp_path / "calibration.json"
    calibration.write_text(f'{{"temperature": {T}}}')
    options = {"option": EngineOptions(device="cpu", dtype="fp32", temperature=T),
               "calibration": EngineOptions(device="cpu", dtype="fp32", calibration=str(calibration)),
               "engine argument": fp32_engine.options}[how]
    engine = Engine(fp32_engine.model, fp32_engine.compiler, options, temperature=T if how == "engine argument" else None)
    assert engine.options.temperature == T
    result = engine.run(request)
    moved = 0.0
    for question, logits in zip(result.compiled.questions, result.logits):
        got = stated_probabilities(result.response, question)
        want = expected_probabilities(logits, T)
        if question.kind == "noul":  # p(true); keys are (true, false)
            want = [want[list(question.keys).index("true")], want[list(question.keys).index("false")]]
        assert got == pytest.approx(want, abs=1e-6), (question.qid, got, want)
        if question.kind != "noul":
            moved = max(moved, max(abs(g - w) for g, w in zip(got, expected_probabilities(logits, 1.0))))
    assert moved > 0.05  # the test tells T from 1.0


def test_the_layout_option_decides_the_layout_that_runs(tiny_export, long_image_request, batch_requests):
    from valen_runtime.engine import Engine
    from valen_runtime.layouts import choose

    base = dict(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast")
    one_pass = Engine.load(tiny_export["separate"], EngineOptions(**base))
    batch = Engine(one_pass.model, one_pass.compiler, EngineOptions(**base, layout="batch"), fast=one_pass.fast)
    compiled, features = one_pass.prepare(long_image_request)
    for engine, kind in ((one_pass, "one-pass"), (batch, "batch")):
        assert engine.plan(compiled).kind == kind
        want = one_pass.execute_plan(compiled, choose(compiled, one_pass.model.config, kind), features)
        assert all(torch.equal(a, b) for a, b in zip(engine.run(long_image_request).logits, want)), kind
    # and with it, batching: the batch layout runs a batch one request at a time
    assert [r.timings["batch"] for r in batch.run_many(batch_requests[:2])] == [1, 1]
    assert [r.timings["batch"] for r in one_pass.run_many(batch_requests[:2])] == [2, 2]


def test_the_batching_option_reaches_run_many(tiny_export, batch_requests):
    from valen_runtime.engine import Engine

    base = dict(device="cpu", dtype="bf16", mode="shared-prefix", kernels="fast")
    batching = Engine.load(tiny_export["separate"], EngineOptions(**base))
    alone = Engine(batching.model, batching.compiler, EngineOptions(**base, batching=False), fast=batching.fast)
    assert batching.batches and not alone.batches
    assert [r.timings["batch"] for r in batching.run_many(batch_requests)] == [len(batch_requests)] * len(batch_requests)
    for request, got in zip(batch_requests, alone.run_many(batch_requests)):
        assert got.timings["batch"] == 1 and all(torch.equal(a, b) for a, b in zip(got.logits, alone.run(request).logits))


def test_the_delta_kernel_option_reaches_every_delta_rule_call(tiny_export, long_image_request, monkeypatch):
    """FLA cannot run on the CPU, so the ops are spied on: every delta-rule call of the fast model
    gets the kernel the options resolved (here set as on CUDA, then run with the reference rule)."""
    import valen_runtime.fast.layers as layers
    from valen_runtime.engine import Engine

    seen = []
    for name in ("gated_delta_rule_op", "gated_delta_rule_varlen_op", "gated_delta_rule_varlen_final_op"):
        def spy(*args, _real=getattr(layers, name)):
            seen.append(args[-1])
            return _real(*args[:-1], "torch")

        monkeypatch.setattr(layers, name, spy)
    for kernel in ("torch", "fla"):
        options = EngineOptions(device="cpu", dtype="bf16", mode="shared-prefix", kernels="fast")
        object.__setattr__(options, "delta_kernel", kernel)  # "fla": as resolved on CUDA (refused on the CPU)
        engine = Engine.load(tiny_export["separate"], options)
        seen.clear()
        engine.run(long_image_request)
        assert seen and set(seen) == {kernel}, (kernel, set(seen))


def test_the_patch_embed_option_picks_the_conv_or_the_gemm(tiny_export, long_image_request):
    from valen_runtime.engine import Engine

    base = dict(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast")
    gemm = Engine.load(tiny_export["separate"], EngineOptions(**base))
    conv = Engine.load(tiny_export["separate"], EngineOptions(**base, patch_embed="conv"))
    assert gemm.options.patch_embed == "linear" and gemm.kernels["patch_embed"] == "linear" and conv.kernels["patch_embed"].startswith("conv")
    for engine, conv_calls in ((gemm, 0), (conv, 1)):
        calls = []
        module = engine.model.vision.patch_embed
        hook = module.register_forward_hook(lambda *_: calls.append(1))
        try:
            compiled, features = engine.prepare(long_image_request)
        finally:
            hook.remove()
        assert len(calls) == conv_calls and features is not None


def test_the_compile_option_compiles_the_fast_path(tiny_export, monkeypatch):
    """torch.compile replaced by a recorder (a real compile takes minutes on the CPU; the slow-marked
    tests run it): compile=True compiles every layer function and the vision block, False none."""
    from valen_runtime.fast.model import FastModel
    from valen_runtime.weights import load_model

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)
    model = load_model(tiny_export["separate"], dtype="fp32")
    for compile in (False, True):
        compiled.clear()
        fast = FastModel.build(model, EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast", compile=compile))
        assert fast.compiled is compile and len(compiled) == (6 if compile else 0), compiled


def test_the_eager_fast_path_on_cuda_runs_without_graphs_by_default():
    eager = EngineOptions(device="cuda", kernels="fast", compile=False)
    assert (eager.mode, eager.graphs) == ("shared-prefix", False)
    assert EngineOptions(device="cuda").graphs and EngineOptions(device="cuda", kernels="torch").graphs
