"""Negative controls: deliberate faults that the harness must report as parity FAILURES.

Each control injects one realistic bug on the runtime / export side and checks that the harness
fails it for the right reason, against the session's bf16 reference (rebuilt from checkpoint.pt,
never from the export). The perturbed-LoRA control runs through the CLI in test_cli.py.

- swapped candidates: the runtime's prompt shows two candidates in the wrong order while keeping
  the keys in request order (probabilities would be attached to the wrong keys) -> token ids.
- un-rounded A_log: the pinned reference computes with BF16-rounded `A_log` (from_pretrained(bf16)
  rounds the base's FP32 values). The runtime cannot *store* FP32 in a BF16 export, so the honest
  version of this bug is a BF16 runtime run that takes the FP32 originals from
  fp32_sources.safetensors and keeps them FP32 in the Gated DeltaNet layers (what a loader that
  "helpfully" upgrades precision would do). Token ids stay equal; the numbers must fail.
- wrong merge scale: a merged export produced with scale 2x (the exporter patched to read
  lora_alpha twice as large); the reference reads the checkpoint's own alpha/rank.
"""

from __future__ import annotations

import json

import pytest
import torch

from parity import harness, tolerances
from valen_runtime.options import EngineOptions

SUBSET = ("text/refund", "text/unicode", "noul/cjk", "score/five_unicode", "mixed/image_three_types")


def _subset(all_cases):
    return [(c, n, r) for c, n, r in all_cases if f"{c}/{n}" in SUBSET]


def _evaluate(export, ref, requests, mode="per-branch", engine=None, dtype="bf16"):
    manifest, sha = harness.manifest_info(export)
    tol = tolerances.select(tolerances.load(), manifest["lora"]["mode"], dtype, "cpu", mode)
    setup = harness.Setup(export, None, None, "cpu", dtype, mode, threads=1)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference ran; the tiny model gains nothing from more
    try:
        return harness.evaluate(setup, requests, ref, tol, manifest, sha, engine=engine)
    finally:
        torch.set_num_threads(previous)


def test_positive_control_subset_passes(tiny_export, bf16_reference, all_cases):
    report = _evaluate(tiny_export["separate"], bf16_reference, _subset(all_cases))
    assert report["verdict"] == "pass", harness.table(report)
    assert report["summary"]["max_abs_dp"] == 0.0


def test_swapped_candidates_in_runtime_prompt_fail(tiny_export, bf16_reference, all_cases, monkeypatch):
    from valen_runtime import request as rt_compile

    original = rt_compile.Compiler._compile_question

    def swapped(self, question, base_length):
        if len(question.candidates) >= 2 and question.kind == "choice":
            cands = list(question.candidates)
            cands[0], cands[1] = cands[1], cands[0]
            out = original(self, rt_compile._ParsedQuestion(question.qid, question.kind, question.instructions, cands), base_length)
            out.keys = [c.key for c in question.candidates]  # keys still in request order: the bug hides
            out.descriptions = [c.description for c in question.candidates]
            return out
        return original(self, question, base_length)

    monkeypatch.setattr(rt_compile.Compiler, "_compile_question", swapped)
    report = _evaluate(tiny_export["separate"], bf16_reference, _subset(all_cases))
    assert report["verdict"] == "fail"
    refund = next(e for e in report["requests"] if e["name"] == "refund")
    assert refund["verdict"] == "fail"
    assert not refund["checks"]["token_ids"]["ok"]
    assert any("suffix_ids differ" in p for p in refund["checks"]["token_ids"]["problems"])
    noul = next(e for e in report["requests"] if e["name"] == "cjk")
    assert noul["verdict"] == "pass"  # the fault touches choice prompts only
    assert "FAIL: token_ids" in harness.table(report)


def test_unrounded_A_log_fails(tiny_export, bf16_reference, all_cases):
    from valen_runtime.engine import Engine
    from valen_runtime.safetensors_file import SafetensorsFile

    export = tiny_export["separate"]
    manifest = json.loads((export / "valen_export.json").read_text())
    engine = Engine.load(export, EngineOptions(device="cpu", dtype="bf16", mode="per-branch"))
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
    report = _evaluate(export, bf16_reference, _subset(all_cases), engine=engine)
    assert report["verdict"] == "fail"
    s = report["summary"]
    assert s["token_ids_equal"] == s["requests"]  # same prompt: a purely numeric fault
    assert s["max_abs_dp"] > 1e-4 > report["tolerance"]["max_abs_dp"]


def test_merge_with_wrong_scale_fails(tiny_fixture, tiny_export, bf16_reference, all_cases, tmp_path, monkeypatch):
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

    good = _evaluate(tiny_export["merged"], bf16_reference, _subset(all_cases))
    assert good["verdict"] == "pass", harness.table(good)  # the correct merge is within its declared tolerance
    report = _evaluate(bad, bf16_reference, _subset(all_cases))
    assert report["verdict"] == "fail"
    assert report["summary"]["max_abs_dp"] > 2 * report["tolerance"]["max_abs_dp"]
    assert report["summary"]["token_ids_equal"] == report["summary"]["requests"]


@pytest.mark.parametrize("mode", ["shared-prefix"])
def test_shared_prefix_mode_within_its_tolerance(tiny_export, bf16_reference, all_cases, mode):
    report = _evaluate(tiny_export["separate"], bf16_reference, _subset(all_cases), mode=mode)
    assert report["verdict"] == "pass", harness.table(report)
    assert report["tolerance"]["mode"] == mode


def test_runtime_crash_is_a_reported_failure(tiny_export, bf16_reference, all_cases, monkeypatch):
    from valen_runtime.engine import Engine

    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="bf16", mode="per-branch"))
    original = engine.run

    def crash_on_images(request):
        if isinstance(request["state"], dict) and "image" in request["state"]:
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
        return original(request)

    monkeypatch.setattr(engine, "run", crash_on_images)
    requests = [(c, n, r) for c, n, r in all_cases if f"{c}/{n}" in ("text/refund", "image/small_png")]
    report = _evaluate(tiny_export["separate"], bf16_reference, requests, engine=engine)
    assert report["verdict"] == "fail"
    ok, crashed = report["requests"]
    assert ok["verdict"] == "pass"
    assert crashed["verdict"] == "fail" and crashed["problems"] == ["runtime raised RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture"]
    assert "FAIL: runtime raised RuntimeError" in harness.table(report)
