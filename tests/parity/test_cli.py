"""`valen-parity` through click's CliRunner: exit codes 0 / 1 / 2, the table and the report JSON.

The reference results come from the session's runs (`references`) through --reference-cache,
so these tests build no reference model of their own (except where a test needs the build to fail).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import torch
from click.testing import CliRunner

from parity.cli import main

THREADS = "1"


def _args(tiny_fixture, export, *extra):
    return ["--export", str(export), "--checkpoint", str(tiny_fixture.checkpoint), "--base", str(tiny_fixture.base), *extra]


def _invoke(args):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.output


def _requests_file(tmp_path, requests):
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for _, _, r in requests) + "\n", encoding="utf-8")
    return path


def test_pass_writes_table_and_report(tiny_fixture, tiny_export, control_requests, references, reference_cache, tmp_path):
    report_path = tmp_path / "report.json"
    code, out = _invoke(
        _args(tiny_fixture, tiny_export["separate"], "--requests", str(_requests_file(tmp_path, control_requests)), "--dtype", "bf16",
              "--threads", THREADS, "--reference-cache", str(reference_cache), "--report", str(report_path), "--pins", str(tiny_fixture.pins))
    )
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["case", "question", "decision"]
    for column in ("truth/ref/runtime", "ref-vs-truth", "rt-vs-truth", "rt-vs-ref", "truth margin", "verdict"):
        assert column in lines[0]
    assert any(line.startswith("requests/line1 ") and line.rstrip().endswith(" ok") for line in lines)
    assert "exact gate: runtime vs reference <= 1.00e-06 per option -> PASS" in lines[-1]

    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["schema"] == "valen-parity-report/2" and report["verdict"] == "pass"
    assert report["setup"]["lora"] == "separate" and report["setup"]["dtype"] == "bf16" and report["setup"]["mode"] == "per-branch"
    assert report["setup"]["references"] == ["bf16", "fp32"] and report["setup"]["truth"] == "fp32"
    assert all(r["cached"] for r in report["references"].values())  # the session's reference runs, not new builds
    assert report["gate"]["gate"] == "exact" and report["bounds"]["per_option"] == 1e-6
    assert report["export_manifest_sha256"] == hashlib.sha256((tiny_export["separate"] / "valen_export.json").read_bytes()).hexdigest()
    for dtype in ("bf16", "fp32"):
        env = report["references"][dtype]["environment"]
        assert env["versions"]["transformers"] == "5.4.0" and env["versions"]["peft"] == "0.18.1" and env["dtype"] == dtype
        kernels = env["kernels"]
        assert kernels["is_flash_linear_attention_available"] is False and kernels["is_causal_conv1d_available"] is False
        assert not any(kernels["find_spec"].values())
        assert kernels["qwen3_5_FusedRMSNormGated"] is None and kernels["qwen3_5_is_fast_path_available"] is False
        assert env["live_model"]["gated_delta_rule"] == ["torch_chunk_gated_delta_rule"]
        assert env["tf32"]["cuda.matmul.allow_tf32"] is False and "cudnn.allow_tf32" in env["tf32"]
        # videos are decoded by torchvision 0.21's PyAV read_video, never torchcodec; the decoder's versions are recorded
        assert kernels["is_torchcodec_available"] is False
        assert env["video_decoder"]["read_video"] == "parity.video_reader.read_video"
        assert env["video_decoder"]["av"] and env["video_decoder"]["ffmpeg"] and "libavcodec" in env["video_decoder"]["libraries"]
    assert report["runtime"]["kernels"] == {"gated_delta": "torch", "attention": "eager"} and report["runtime"]["cuda_graphs"] is False
    assert report["runtime"]["dtype"] == "bfloat16" and report["runtime"]["mode"] == "per-branch"
    s = report["summary"]
    assert s["requests"] == len(control_requests) and s["failed_requests"] == 0
    assert s["errors"]["runtime_vs_reference"]["max"] == 0.0  # separate LoRA, per-branch: bitwise equal to the reference
    assert s["errors"]["runtime_vs_truth"] == s["errors"]["reference_vs_truth"] and s["errors"]["reference_vs_truth"]["max"] > 0
    assert s["token_ids_equal"] == s["usage_equal"] == s["rotary_equal"] == len(control_requests)
    assert s["max_pixel_values_abs"] == 0.0 and s["max_rotary_abs"] == 0.0
    q = report["requests"][0]["questions"][0]
    assert set(q["p"]) == {"bf16", "fp32", "runtime"} and set(q["logits"]) == {"bf16", "fp32", "runtime"}
    assert set(q["errors"]) == {"reference_vs_truth", "runtime_vs_truth", "runtime_vs_reference"}
    assert len(q["errors_per_option"]["runtime_vs_truth"]) == len(q["keys"])
    for key in ("decision", "margin", "confidence", "score", "verdict", "judged_error", "decision_gated"):
        assert key in q, key
    assert set(report["requests"][0]["checks"]) >= {"token_ids", "usage", "rotary", "answer_formula"}
    assert any("pixel_values" in e["checks"] for e in report["requests"])


def test_shared_prefix_bf16_reports_its_dual_check(tiny_fixture, tiny_export, control_requests, references, reference_cache, tmp_path):
    report_path = tmp_path / "r.json"
    code, out = _invoke(
        _args(tiny_fixture, tiny_export["separate"], "--requests", str(_requests_file(tmp_path, control_requests)), "--mode", "shared-prefix",
              "--kernels", "fast", "--threads", THREADS, "--reference-cache", str(reference_cache), "--report", str(report_path))
    )
    assert code == 0, out
    assert "dual (fp32) run of the same runtime options:" in out and "fp32-rounding gate" in out.splitlines()[-1]
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["gate"]["gate"] == "truth-relative" and report["bounds"]["judged"] == "runtime vs fp32 truth"
    assert report["dual"]["gate"]["gate"] == "fp32-rounding" and report["dual"]["setup"]["dtype"] == "fp32"
    assert report["dual"]["bounds"]["per_option"] < 1e-3 < report["bounds"]["per_option"]
    # The fast path, eager on the CPU, in the one-pass layout the engine plans for it.
    assert report["setup"]["runtime_options"] == {"device": "cpu", "dtype": "bf16", "mode": "shared-prefix", "kernels": "fast",
                                                  "graphs": False, "compile": False, "layout": "one-pass", "delta_kernel": "torch",
                                                  "patch_embed": "linear", "batching": True, "temperature": 1.0, "calibration": None}
    assert report["runtime"]["kernels"]["layers"] == "fused, eager" and report["runtime"]["layout"] == "one-pass"


def test_fp32_on_the_cpu_uses_the_fp64_truth(tiny_fixture, tiny_export, control_requests, references, reference_cache, tmp_path):
    report_path = tmp_path / "r.json"
    code, out = _invoke(
        _args(tiny_fixture, tiny_export["separate"], "--requests", str(_requests_file(tmp_path, control_requests)), "--dtype", "fp32",
              "--threads", THREADS, "--reference-cache", str(reference_cache), "--report", str(report_path))
    )
    assert code == 0, out
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["setup"]["truth"] == "fp64" and report["setup"]["references"] == ["fp32", "fp64"]
    assert 0 < report["summary"]["errors"]["reference_vs_truth"]["max"] < 1e-4  # the fp32 reference's own rounding


def test_perturbed_lora_element_fails(tiny_fixture, tiny_export, control_requests, references, reference_cache, tmp_path):
    from parity.controls import perturb_lora_element

    bad = tmp_path / "perturbed"
    name = perturb_lora_element(tiny_export["separate"], bad)
    report_path = tmp_path / "r.json"
    code, out = _invoke(
        _args(tiny_fixture, bad, "--requests", str(_requests_file(tmp_path, control_requests)), "--dtype", "bf16", "--threads", THREADS,
              "--reference-cache", str(reference_cache), "--report", str(report_path))
    )
    assert code == 1, out
    assert "-> FAIL" in out.splitlines()[-1] and "FAIL: |Δp|" in out
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["verdict"] == "fail" and report["summary"]["errors"]["runtime_vs_reference"]["max"] > 1e-6
    assert report["summary"]["token_ids_equal"] == report["summary"]["requests"]  # the prompt is right; the numbers are not
    assert ".lora_A." in name


def _one_line_error(code, out):
    assert code == 2, out
    assert "Traceback" not in out
    assert out.startswith("error: ") and out.count("\n") == 1, out
    return out


def test_usage_errors_exit_2(tiny_fixture, tiny_export, tmp_path):
    out = _one_line_error(*_invoke(_args(tiny_fixture, tmp_path / "nope", "--case", "text")))
    assert "--export must be an existing directory" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "cannot read the export manifest" in _one_line_error(*_invoke(_args(tiny_fixture, empty, "--case", "text")))
    assert "nothing to run" in _one_line_error(*_invoke(_args(tiny_fixture, tiny_export["separate"])))
    bad_requests = tmp_path / "bad.jsonl"
    bad_requests.write_text("{not json\n")
    assert "bad.jsonl:1: not a JSON request" in _one_line_error(*_invoke(_args(tiny_fixture, tiny_export["separate"], "--requests", str(bad_requests))))
    from parity import tolerances

    data = json.loads(tolerances.DEFAULT_PATH.read_text())
    data["entries"] = [e for e in data["entries"] if e["lora"] != "merged"]
    tol_path = tmp_path / "tol.json"
    tol_path.write_text(json.dumps(data))
    out = _one_line_error(*_invoke(_args(tiny_fixture, tiny_export["merged"], "--case", "text", "--tolerances", str(tol_path))))
    assert "no tolerance declared for lora=merged dtype=bf16 device=cpu mode=per-branch" in out
    no_ckpt = tmp_path / "ckpt"
    no_ckpt.mkdir()
    out = _one_line_error(*_invoke(["--export", str(tiny_export["separate"]), "--checkpoint", str(no_ckpt), "--base", str(tiny_fixture.base), "--case", "text"]))
    assert "checkpoint.pt: missing" in out


def test_valen_source_at_another_commit_is_refused(tiny_fixture, tiny_export, tmp_path):
    import subprocess

    repo = tmp_path / "Valen"
    (repo / "valen").mkdir(parents=True)
    (repo / "valen" / "__init__.py").write_text("")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=env, capture_output=True)
    out = _one_line_error(*_invoke(_args(tiny_fixture, tiny_export["separate"], "--case", "text", "--valen-source", str(repo))))
    assert "not the pinned Valen commit" in out


def test_reference_refuses_a_checkpoint_missing_a_trainable_tensor(tiny_fixture, tiny_export, tmp_path):
    """The strict trainable-set check runs in the reference process and surfaces as one line, exit 2."""
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(tiny_fixture.checkpoint, ckpt)
    payload = torch.load(ckpt / "checkpoint.pt", weights_only=True)
    dropped = sorted(payload["weights"])[0]
    del payload["weights"][dropped]
    torch.save(payload, ckpt / "checkpoint.pt")
    # fp32 without fp64: one reference process (the truth's), which every run starts; the check
    # is the same in every dtype's process.
    out = _one_line_error(*_invoke(["--export", str(tiny_export["separate"]), "--checkpoint", str(ckpt), "--base", str(tiny_fixture.base), "--case", "noul",
                                    "--dtype", "fp32", "--no-fp64", "--threads", THREADS]))
    assert "Trainable checkpoint mismatch" in out and dropped in out and "(reference process, fp32, exit 3)" in out
