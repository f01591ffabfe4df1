"""`valen-parity` through click's CliRunner: exit codes 0 / 1 / 2, the table and the report JSON.

The reference results come from the session's bf16 run (`bf16_reference`) through
--reference-cache, so these tests build the reference model once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import torch
from click.testing import CliRunner

from parity.cli import main

THREADS = "1"


def _args(tiny_fixture, export, *extra):
    return ["--export", str(export), "--checkpoint", str(tiny_fixture.checkpoint), "--base", str(tiny_fixture.base), *extra]


def _invoke(args):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.output


def perturb_lora_element(src, dst, name_part="layers.3.mlp.down_proj.lora_B", delta=0.5):
    """Copy an export and add `delta` to one FP32 element of one LoRA tensor, in place in the
    safetensors bytes; the manifest's sha256 is updated so the runtime loads it without complaint."""
    shutil.copytree(src, dst)
    path = dst / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if name_part in k)
    start = 8 + n + header[name]["data_offsets"][0]
    (value,) = struct.unpack("<f", data[start : start + 4])
    data[start : start + 4] = struct.pack("<f", value + delta)
    path.write_bytes(bytes(data))
    manifest_path = dst / "valen_export.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["adapter_model.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return name


def test_pass_writes_table_and_report(tiny_fixture, tiny_export, bf16_reference, all_cases, reference_cache, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(r, ensure_ascii=False) for _, _, r in all_cases) + "\n", encoding="utf-8")
    report_path = tmp_path / "report.json"
    code, out = _invoke(
        _args(tiny_fixture, tiny_export["separate"], "--requests", str(requests), "--dtype", "bf16", "--threads", THREADS,
              "--reference-cache", str(reference_cache), "--report", str(report_path), "--pins", str(tiny_fixture.pins))
    )
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["case", "question", "decision"]
    assert "max |Δp|" in lines[0] and "margin" in lines[0] and "verdict" in lines[0]
    assert any(line.startswith("requests/line1 ") and " ok" in line for line in lines)
    assert "-> PASS" in lines[-1]

    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["schema"] == "valen-parity-report/1" and report["verdict"] == "pass"
    assert report["reference"]["cached"] is True  # the session's reference run, not a second build
    assert report["setup"]["lora"] == "separate" and report["setup"]["dtype"] == "bf16" and report["setup"]["mode"] == "per-branch"
    assert report["tolerance"]["lora"] == "separate" and report["tolerance"]["max_abs_dp"] == 1e-6
    assert report["export_manifest_sha256"] == hashlib.sha256((tiny_export["separate"] / "valen_export.json").read_bytes()).hexdigest()
    env = report["reference"]["environment"]
    assert set(env["versions"]) >= {"torch", "transformers", "peft", "tokenizers", "torchvision"}
    assert env["versions"]["transformers"] == "5.4.0" and env["versions"]["peft"] == "0.18.1"
    kernels = env["kernels"]
    assert kernels["is_flash_linear_attention_available"] is False and kernels["is_causal_conv1d_available"] is False
    assert not any(kernels["find_spec"].values())
    assert kernels["qwen3_5_FusedRMSNormGated"] is None and kernels["qwen3_5_is_fast_path_available"] is False
    assert env["live_model"]["gated_delta_rule"] == ["torch_chunk_gated_delta_rule"]
    assert env["tf32"]["cuda.matmul.allow_tf32"] is False and "cudnn.allow_tf32" in env["tf32"]
    assert env["device"] == "cpu" and env["dtype"] == "bf16"
    assert report["runtime"]["kernels"] == {"gated_delta": "torch", "attention": "eager"} and report["runtime"]["cuda_graphs"] is False
    assert report["runtime"]["dtype"] == "bfloat16" and report["runtime"]["mode"] == "per-branch"
    s = report["summary"]
    assert s["requests"] == len(all_cases) and s["failed_requests"] == 0
    assert s["max_abs_dp"] == 0.0  # separate LoRA, per-branch: bitwise equal to the reference
    assert s["token_ids_equal"] == s["usage_equal"] == len(all_cases)
    assert s["max_pixel_values_abs"] == 0.0
    q = report["requests"][0]["questions"][0]
    for key in ("p_ref", "p_runtime", "dp", "max_abs_dp", "logits_ref", "logits_runtime", "margin", "decision_ref", "decision_runtime", "confidence_ref", "confidence_runtime", "verdict"):
        assert key in q, key
    assert set(report["requests"][0]["checks"]) >= {"token_ids", "usage", "answer_formula"}
    assert any("pixel_values" in e["checks"] for e in report["requests"])
    usage = report["requests"][0]["checks"]["usage"]
    assert usage["ok"] and usage["runtime"]["output_tokens"] == 0


def test_perturbed_lora_element_fails(tiny_fixture, tiny_export, bf16_reference, reference_cache, tmp_path):
    bad = tmp_path / "perturbed"
    name = perturb_lora_element(tiny_export["separate"], bad)
    report_path = tmp_path / "r.json"
    code, out = _invoke(
        _args(tiny_fixture, bad, "--case", "all", "--dtype", "bf16", "--threads", THREADS, "--reference-cache", str(reference_cache), "--report", str(report_path))
    )
    assert code == 1, out
    assert "-> FAIL" in out.splitlines()[-1] and "FAIL: max |Δp|" in out
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["verdict"] == "fail" and report["summary"]["max_abs_dp"] > 1e-6
    assert report["summary"]["token_ids_equal"] == report["summary"]["requests"]  # the prompt is right; the numbers are not
    assert ".lora_B." in name


def test_fast_kernels_pass_the_shared_prefix_gate(tiny_fixture, tiny_export, bf16_reference, reference_cache, tmp_path):
    # The fast path (its one-pass layout, chosen by the engine) is judged by the same declared entry
    # as the shared-prefix mode it runs.
    report_path = tmp_path / "r.json"
    code, out = _invoke(
        _args(tiny_fixture, tiny_export["separate"], "--case", "all", "--dtype", "bf16", "--mode", "shared-prefix", "--kernels", "fast",
              "--threads", THREADS, "--reference-cache", str(reference_cache), "--report", str(report_path))
    )
    assert code == 0, out
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["setup"]["engine_options"] == {"device": "cpu", "dtype": "bf16", "mode": "shared-prefix", "kernels": "fast",
                                                 "graphs": False, "compile": False}
    assert report["runtime"]["kernels"]["layers"] == "fused, eager"


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
    out = _one_line_error(*_invoke(["--export", str(tiny_export["separate"]), "--checkpoint", str(ckpt), "--base", str(tiny_fixture.base), "--case", "noul", "--threads", THREADS]))
    assert "Trainable checkpoint mismatch" in out and dropped in out
