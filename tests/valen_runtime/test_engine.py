"""Engine and valen-run: end to end on the tiny export, import hygiene, CLI exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from valen_runtime.cli import main as valen_run

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
        f"e = Engine.load({str(tiny_export['separate'])!r}, device='cpu', dtype='bf16')\n"
        f"e.answer(json.loads({json.dumps(json.dumps(TEXT_REQUEST))}))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('peft', 'torchvision') or m.startswith('transformers'))\n"
        "print(json.dumps({'bad': bad, 'torch_load_calls': len(calls)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"bad": [], "torch_load_calls": 0}


def test_response_shape_and_usage(tiny_export):
    from valen_runtime.engine import Engine

    result = Engine.load(tiny_export["merged"], device="cpu", dtype="fp32").run(TEXT_REQUEST)
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
    args = ["--export", str(tiny_export["separate"]), "--device", "cpu", "--mode", "shared-prefix", "--cuda-graphs", str(req)]
    result = CliRunner().invoke(valen_run, args)
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "CUDA graphs" in result.output


def test_valen_run_shared_prefix_fast_kernels_on_the_cpu(tiny_export, tmp_path):
    """The fast path's fused layers run eagerly on the CPU (what the CPU parity gate checks)."""
    from valen_runtime.engine import Engine

    fast = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast")
    assert fast.kernels["layers"] == "fused, eager"
    torch_path = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix")
    for a, b in zip(fast.run(TEXT_REQUEST).logits, torch_path.run(TEXT_REQUEST).logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # fp32: conv / LoRA summation order only


def test_vision_started_inside_the_compile_gives_the_same_logits(tiny_export):
    # On CUDA Engine.run queues the vision tower from the compiler's on_images hook; forced on
    # here, the result must equal the plain order (compile, then vision).
    import base64
    import io

    import numpy as np
    from PIL import Image

    from valen_runtime.engine import Engine

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (60, 90, 3), dtype=np.uint8)).save(buffer, "PNG")
    req = dict(TEXT_REQUEST, state={"image": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()})
    engine = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32")
    calls = []
    real = engine.vision_features
    engine.vision_features = lambda images: calls.append(1) or real(images)
    engine.overlap_vision = False
    plain = engine.run(req)
    engine.overlap_vision = True
    overlapped = engine.run(req)
    assert calls == [1, 1]
    for a, b in zip(plain.logits, overlapped.logits):
        assert torch.equal(a, b)


def test_bf16x3_lora_engine_answers_like_the_fp32_lora_engine(tiny_export):
    # lora_gemm="bf16x3" changes only fp32 rounding order inside the LoRA delta, which the bf16
    # output rounding almost always hides (on this request the logits came out bitwise equal).
    from valen_runtime.engine import Engine

    options = dict(device="cpu", dtype="bf16", mode="shared-prefix", kernels="fast", compile=False)
    fp32 = Engine.load(tiny_export["separate"], **options).run(TEXT_REQUEST)
    split = Engine.load(tiny_export["separate"], lora_gemm="bf16x3", **options).run(TEXT_REQUEST)
    for a, b in zip(fp32.logits, split.logits):
        torch.testing.assert_close(b, a, rtol=0, atol=0.02)
    with pytest.raises(ValueError, match="needs kernels='fast'"):
        Engine.load(tiny_export["separate"], device="cpu", dtype="bf16", lora_gemm="bf16x3")


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
    from valen_runtime.engine import Engine

    engine = Engine.load(tiny_export[lora], device="cpu", dtype=dtype, mode="per-branch")
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
