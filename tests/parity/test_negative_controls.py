"""Negative controls: deliberate defects the parity gate must FAIL, in every CPU gate
configuration that runs the damaged code, for the right reason; the undamaged runtime on the same
requests passes every configuration (so a failure is the control's doing).

The controls of `parity.controls` (the gate's own, also run on CUDA by `parity.gate --controls`):
+0.05 on one LoRA element (re-hashed export), the fast path's GDN l2norm in bf16, the M-RoPE
height/width sections swapped, two probabilities swapped in Engine.run, smart_resize rounding
half up. Below them, older controls of the prompt and the loader: swapped candidates in the
runtime's prompt, un-rounded A_log, a merge with the wrong scale, a runtime crash.
"""

from __future__ import annotations

import json

import pytest
import torch

from parity import controls, gate, harness, runtime_adapter, tolerances
from parity.report import table
from parity.runtime_adapter import EngineOptions

from .conftest import CONTROL_REQUESTS, THREADS

CONFIGS = gate.configurations("cpu")
CASES = [(control, config) for control in controls.CONTROLS for config in CONFIGS if control.exercised_by(config.lora, config.options)]


def _gate(config):
    return tolerances.select(tolerances.load(), config.lora, config.options.dtype, "cpu", config.options.mode)


def _reasons(report: dict) -> set[str]:
    """What failed: check names, "numbers" (a per-option or decision rule), "distribution"; a
    "dual:" prefix for the dual check's part."""
    out = set()
    for e in report["requests"]:
        out |= {p.split(":")[0] for p in e["problems"] if ":" in p}
        if any(q.get("verdict") == "fail" for q in e["questions"]):
            out.add("numbers")
    if report["distribution"].get("problems"):
        out.add("distribution")
    if report.get("dual") is not None:
        out |= {"dual:" + r for r in _reasons(report["dual"])}
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_undamaged_runtime_passes_every_configuration(config, tiny_fixture, tiny_export, control_requests, references):
    report = gate.run_config(config, tiny_export[config.lora], tiny_fixture, control_requests, references, _gate(config), THREADS)
    assert report["verdict"] == "pass", table(report)
    s = report["summary"]
    assert s["token_ids_equal"] == s["usage_equal"] == s["rotary_equal"] == s["requests"] == len(control_requests)


EXPECTED = {
    # What each control must trip (at least): a numeric rule of the run itself for exact and fp32
    # gates, else of its dual check; the exact checks for the rest.
    "lora-element": "numbers",
    "l2norm-dtype": "numbers",
    "mrope-sections": "rotary",
    "probabilities-swap": "answer_formula",
    "resize-half-up": "token_ids",
    "temperature-ignored": "answer_formula",  # the response's numbers are not softmax(logits / T)
}


@pytest.mark.parametrize("control, config", CASES, ids=[f"{c.name}-{g.name}" for c, g in CASES])
def test_control_fails_the_gate(control, config, tiny_fixture, tiny_export, control_requests, references, tmp_path):
    export = tiny_export[config.lora]
    if control.damages_export:
        export = tmp_path / "damaged"
        name = controls.perturb_lora_element(tiny_export[config.lora], export)
        assert controls.LORA_TENSOR in name
    requests = controls.subset(control, control_requests, CONTROL_REQUESTS)
    report = gate.run_control(control, config, export, tiny_fixture, requests, references, _gate(config), THREADS, fail_fast=False)
    assert report["verdict"] == "fail", table(report)
    reasons = _reasons(report)
    want = EXPECTED[control.name]
    if want == "numbers" and _gate(config).kind == "truth-relative":
        want = "dual:numbers"  # rounding of bf16 or of merged weights hides it there; the fp32 dual check shows it
    assert want in reasons, (reasons, table(report))
    if control.name in ("lora-element", "l2norm-dtype"):  # purely numeric: the prompt is right
        s = report["summary"]
        assert s["token_ids_equal"] == s["rotary_equal"] == s["requests"]


@pytest.mark.parametrize("lora, anchor_step", [("separate", False), ("merged", True)])
def test_fail_fast_stops_at_the_fp32_part_that_fails(lora, anchor_step, tiny_fixture, tiny_export, control_requests, references):
    # What the GPU gate does (each damaged compiled path costs a compile there): the fp32 run
    # under its own entry first; for a merged export, whose fp32 entry is loose, then the anchor.
    config = next(g for g in CONFIGS if g.lora == lora and g.options.dtype == "bf16" and g.options.kernels == "fast")
    control = controls.BY_NAME["l2norm-dtype"]
    fp32_gate = tolerances.select(tolerances.load(), lora, "fp32", "cpu", "shared-prefix")
    requests = controls.subset(control, control_requests, CONTROL_REQUESTS)
    report = gate.run_control(control, config, tiny_export[lora], tiny_fixture, requests, references, _gate(config), THREADS,
                              fail_fast=True, fp32_gate=fp32_gate)
    assert report["verdict"] == "fail" and report["setup"]["dtype"] == "fp32"
    assert ("against the module path" in report["note"]) is anchor_step
    assert report["gate"]["gate"] == "fp32-rounding"


def test_every_control_has_a_configuration_and_requests(control_requests):
    for control in controls.CONTROLS:
        assert any(c is control for c, _ in CASES), control.name
        assert controls.subset(control, control_requests, CONTROL_REQUESTS)
    # The configurations the l2norm control must fail are exactly the fast-kernel ones.
    assert {g.name for c, g in CASES if c.name == "l2norm-dtype"} == {g.name for g in CONFIGS if g.options.kernels == "fast"}


def test_the_video_set_exercises_the_mrope_control_and_says_which_controls_it_cannot():
    """Video positions use M-RoPE's height and width sections too; smart_resize's half-to-even edge
    needs images of particular sizes, which the video group has not."""
    from parity import generator

    videos = generator.SETS["video"]()
    assert controls.subset(controls.BY_NAME["mrope-sections"], videos, 4)
    with pytest.raises(ValueError, match="control resize-half-up: no request in the set exercises it"):
        controls.subset(controls.BY_NAME["resize-half-up"], videos, 4)


def test_perturbed_export_leaves_the_original_untouched(tiny_export, tmp_path):
    original = tiny_export["separate"] / "adapter_model.safetensors"
    before = original.read_bytes()
    controls.perturb_lora_element(tiny_export["separate"], tmp_path / "damaged")
    assert original.read_bytes() == before  # hard links: the changed file is a new one
    assert (tmp_path / "damaged" / "adapter_model.safetensors").read_bytes() != before


# ---------------------------------------------------------------- prompt and loader controls


def _per_branch(export, requests, references, engine=None, dtype="bf16"):
    options = EngineOptions("cpu", dtype, "per-branch")
    manifest, _ = harness.manifest_info(export)
    g = tolerances.select(tolerances.load(), manifest["lora"]["mode"], dtype, "cpu", "per-branch")
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        run = runtime_adapter.run(export, options, requests, engine=engine)
    finally:
        torch.set_num_threads(previous)
    return harness.evaluate(harness.Setup(export, None, None, options, threads=THREADS), requests, references, g, run)


def test_swapped_candidates_in_runtime_prompt_fail(tiny_export, control_requests, references, monkeypatch):
    from dataclasses import replace

    from valen_runtime import request as rt_request

    original = rt_request.Compiler._compile_question

    def swapped(self, question, base_length):
        if len(question.candidates) >= 2 and question.kind == "choice":
            cands = list(question.candidates)
            cands[0], cands[1] = cands[1], cands[0]
            out = original(self, replace(question, candidates=tuple(cands)), base_length)
            out.keys = [c.key for c in question.candidates]  # keys still in request order: the bug hides
            out.descriptions = [c.description for c in question.candidates]
            return out
        return original(self, question, base_length)

    monkeypatch.setattr(rt_request.Compiler, "_compile_question", swapped)
    report = _per_branch(tiny_export["separate"], control_requests, references)
    assert report["verdict"] == "fail"
    choice = next(e for e in report["requests"] if any(q["kind"] == "choice" and len(q["keys"]) >= 2 for q in e["questions"]))
    assert not choice["checks"]["token_ids"]["ok"]
    assert any("suffix_ids differ" in p for p in choice["checks"]["token_ids"]["problems"])
    assert "FAIL" in table(report)


def test_unrounded_A_log_fails(tiny_export, control_requests, references):
    from valen_runtime.safetensors_file import SafetensorsFile

    export = tiny_export["separate"]
    manifest = json.loads((export / "valen_export.json").read_text())
    engine = runtime_adapter.load_engine(export, EngineOptions("cpu", "bf16", "per-branch"))
    sources = SafetensorsFile(export / manifest["fp32_sources"]["file"])
    replaced = 0
    for name, value in sources.iter_tensors():
        short = name[len(manifest["language"]["prefix"]):]
        if short.endswith("linear_attn.A_log"):
            layer = engine.model.text.get_submodule(short.rsplit(".", 1)[0])
            assert layer.A_log.dtype == torch.bfloat16
            assert not torch.equal(layer.A_log.float(), value.float())  # the rounding is real
            layer.A_log = torch.nn.Parameter(value.float(), requires_grad=False)
            replaced += 1
    assert replaced == 3
    report = _per_branch(export, control_requests, references, engine=engine)
    assert report["verdict"] == "fail"
    s = report["summary"]
    assert s["token_ids_equal"] == s["requests"]  # same prompt: a purely numeric fault
    assert s["errors"]["runtime_vs_reference"]["max"] > 1e-4 > report["bounds"]["per_option"]


def test_merge_with_wrong_scale_fails(tiny_fixture, tiny_export, control_requests, references, tmp_path, monkeypatch):
    import valen_export.export as exporter

    original = exporter.open_checkpoint

    def doubled_alpha(*args, **kwargs):
        ckpt = original(*args, **kwargs)
        ckpt.config = dict(ckpt.config, lora_alpha=2 * ckpt.config["lora_alpha"])
        return ckpt

    monkeypatch.setattr(exporter, "open_checkpoint", doubled_alpha)
    bad = tmp_path / "merged-scale-x2"
    exporter.export(tiny_fixture.checkpoint, tiny_fixture.base, bad, lora_mode="merged", pins_path=tiny_fixture.pins, progress=False)
    monkeypatch.setattr(exporter, "open_checkpoint", original)
    assert json.loads((bad / "valen_export.json").read_text())["lora"]["scale"] == 4.0

    good = _per_branch(tiny_export["merged"], control_requests, references)
    assert good["verdict"] == "pass", table(good)  # the correct merge is within its declared gate
    report = _per_branch(bad, control_requests, references)
    assert report["verdict"] == "fail"
    assert report["summary"]["max_judged_error"] > 2 * report["bounds"]["per_option"]
    assert report["summary"]["token_ids_equal"] == report["summary"]["requests"]


def test_runtime_crash_is_a_reported_failure(tiny_export, control_requests, references):
    engine = runtime_adapter.load_engine(tiny_export["separate"], EngineOptions("cpu", "bf16", "per-branch"))
    original = engine.run

    def crash_on_images(request):
        if "data:image/" in json.dumps(request["state"]):
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
        return original(request)

    engine.run = crash_on_images
    report = _per_branch(tiny_export["separate"], control_requests, references, engine=engine)
    assert report["verdict"] == "fail"
    by_kind = {"image" in e["name"] or e["name"].endswith(("png", "jpeg", "half")): e for e in report["requests"]}
    crashed = [e for e in report["requests"] if e["problems"] == ["runtime raised RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture"]]
    assert crashed and all(e["verdict"] == "fail" for e in crashed)
    assert any(e["verdict"] == "pass" for e in report["requests"])  # the text requests still compare
    assert by_kind
    assert "FAIL" in table(report)
