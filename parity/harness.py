"""Runtime-vs-reference comparison of one configuration: which reference runs it needs, and the
report of a runtime run against them.

- The reference runs in its own process (`parity.reference_run`), rebuilt from the training
  checkpoint and the base, in the requested dtype and in fp32 (the truth), plus bf16 where the
  gate scales with the bf16 reference's own error, plus fp64 for fp32 runs on the CPU.
- The runtime runs through `parity.runtime_adapter` on the export.
- `parity.compare` measures and judges; `parity.report` writes the report and the table.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from . import compare, report, runtime_adapter
from .errors import UsageProblem
from .reference_run import ReferenceRun
from .runtime_adapter import EngineOptions, RuntimeRun
from .tolerances import Gate


@dataclass
class Setup:
    export: Path
    checkpoint: Path | None
    base: Path | None
    options: EngineOptions
    valen_source: str | None = None
    threads: int | None = None


def reference_dtypes(gate: Gate, device: str, fp64: bool) -> list[str]:
    """The requested dtype, the fp32 truth, bf16 where a bound scales with its error (and for the
    dual check), fp64 for fp32 runs on the CPU (when asked for)."""
    need = {gate.dtype, "fp32"}
    if gate.needs_bf16_yardstick or gate.dual is not None:
        need.add("bf16")
    if fp64 and device == "cpu" and gate.dtype == "fp32":
        need.add("fp64")
    return [d for d in ("bf16", "fp32", "fp64") if d in need]


class AnchorRun:
    """The runtime's fp32 module-path run standing in for the fp32 reference's logits (the dual
    check of a merged export); prompts, pixels and rotary tables stay the reference's."""

    def __init__(self, reference: ReferenceRun, anchor: RuntimeRun):
        self.reference = reference
        self.data, self.seconds, self.cached = reference.data, anchor.seconds, False
        self.by_id = {}
        for rid, rec in reference.by_id.items():
            outcome = anchor.outcomes.get(rid)
            if outcome is None:
                continue
            if outcome.result is None:
                self.by_id[rid] = {"id": rid, "ok": False, "error": f"anchor run: {outcome.rejected or outcome.crashed}"}
            else:
                self.by_id[rid] = dict(rec, logits=[[float(x) for x in lg.float().tolist()] for lg in outcome.result.logits])

    def pixel_values(self, rid: str):
        return self.reference.pixel_values(rid)

    def pixel_values_videos(self, rid: str):
        return self.reference.pixel_values_videos(rid)

    def rotary(self, rid: str):
        return self.reference.rotary(rid)


def manifest_info(export: Path) -> tuple[dict, str]:
    path = Path(export) / "valen_export.json"
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except OSError as e:
        raise UsageProblem(f"{path}: cannot read the export manifest ({e.strerror or e}); --export must be a valen-export directory") from None
    except ValueError as e:
        raise UsageProblem(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("lora"), dict) or data["lora"].get("mode") not in ("separate", "merged"):
        raise UsageProblem(f"{path}: no lora.mode separate/merged; not a valen-native/1 export manifest")
    return data, hashlib.sha256(raw).hexdigest()


def check_pins(pins: dict | None, manifest: dict, ref: ReferenceRun, base: Path) -> list[str]:
    """The export, the checkpoint the reference loaded and (optionally) a pins file must agree."""
    problems = []
    ck = ref.data["checkpoint_sha256"]
    src = (manifest.get("source") or {}).get("checkpoint_sha256")
    if src != ck:
        problems.append(f"the export was made from checkpoint.pt {src}, but --checkpoint holds {ck}")
    if pins is not None:
        want = (pins.get("checkpoint") or {}).get("checkpoint_sha256")
        if want != ck:
            problems.append(f"pins expect checkpoint.pt {want}, --checkpoint holds {ck}")
        try:
            base_rev = json.loads((Path(base) / "valen_manifest.json").read_text()).get("revision")
        except (OSError, ValueError):
            base_rev = None
        if (pins.get("base") or {}).get("revision") != base_rev:
            problems.append(f"pins expect base revision {(pins.get('base') or {}).get('revision')}, --base has {base_rev}")
    return problems


def evaluate(setup: Setup, requests: list[tuple[str, str, dict]], refs: dict[str, ReferenceRun], gate: Gate, runtime: RuntimeRun,
             fp32_run: RuntimeRun | None = None, anchor: RuntimeRun | None = None) -> dict:
    """The report of `runtime` against the reference runs `refs` ({dtype: ReferenceRun}) under
    `gate`. A gate with a dual check also judges the fp32 run of the same options (`runtime`
    itself for an fp32 gate, else `fp32_run`) by the fp32-rounding gate against its anchor: the fp32
    reference, or `anchor` (the runtime's fp32 module-path run on the same export)."""
    ids = [f"{c}/{n}" for c, n, _ in requests]
    bf16_err = compare.bf16_error(refs, ids, setup.options.temperature)
    out = judge_run(setup, requests, refs, gate, runtime, bf16_err)
    dual_report, dual_note = None, None
    if gate.dual is not None:
        run32 = runtime if setup.options.dtype == "fp32" else fp32_run
        if run32 is None:
            raise ValueError(f"gate {'/'.join(gate.key)} has a dual check: pass the fp32 run of the same options")
        dual_setup = Setup(setup.export, setup.checkpoint, setup.base, run32.options, setup.valen_source, setup.threads)
        if gate.dual == "reference":
            dual_report = judge_run(dual_setup, requests, {d: r for d, r in refs.items() if d != "fp64"}, gate.dual_gate, run32, bf16_err)
        elif run32.options == runtime_adapter.module_path_options(setup.options):
            dual_note = "the fp32 run is the module-path anchor itself"
        elif anchor is None:
            raise ValueError(f"gate {'/'.join(gate.key)} checks its fp32 run against the module path: pass that run as anchor")
        else:
            substituted = {"bf16": refs["bf16"], "fp32": AnchorRun(refs["fp32"], anchor)}
            dual_report = judge_run(dual_setup, requests, substituted, gate.dual_gate, run32, bf16_err)
            dual_report["setup"]["anchor"] = f"runtime {runtime_adapter.label(anchor.options)} on the same export (in place of the fp32 reference)"
    out["dual"], out["dual_note"] = dual_report, dual_note
    out["verdict"] = "pass" if out["own_verdict"] == "pass" and (dual_report is None or dual_report["verdict"] == "pass") else "fail"
    return out


def judge_run(setup: Setup, requests, refs: dict, gate: Gate, runtime: RuntimeRun, bf16_err: float | None) -> dict:
    """One run's report under `gate` against `refs` (no dual check); `bf16_err`: E_bf16."""
    requested = setup.options.dtype
    if requested not in refs or "fp32" not in refs:
        raise ValueError(f"evaluate needs the {requested} and fp32 reference runs, got {sorted(refs)}")
    manifest, manifest_sha = manifest_info(setup.export)
    entries = []
    for case, name, _ in requests:
        rid = f"{case}/{name}"
        records = {dtype: run.by_id[rid] for dtype, run in refs.items()}
        # Questions are measured only where every reference accepted the request (a rejection is
        # decided by the requested dtype's record).
        usable = records if all(r["ok"] for r in records.values()) else {requested: records[requested]}
        ref_run = refs[requested]
        entries.append(compare.measure_request(case, name, usable, requested, runtime.outcomes[rid], gate,
                                               ref_pixels=ref_run.pixel_values(rid), ref_rotary=ref_run.rotary(rid),
                                               temperature=setup.options.temperature, ref_pixels_videos=ref_run.pixel_values_videos(rid)))
    try:
        bounds = compare.gate_bounds(gate, bf16_err)
    except ValueError as e:
        raise UsageProblem(str(e)) from None
    if isinstance(refs.get("fp32"), AnchorRun):
        bounds["judged"] = "runtime vs the module-path anchor"
    distribution = compare.judge(gate, entries, bounds, requested)
    truth = report.truth_dtype(requested, list(refs))
    report.add_error_columns(entries, requested, truth)
    own_verdict = "pass" if all(e["verdict"] == "pass" for e in entries) and distribution.get("ok", True) else "fail"
    return {
        "schema": report.REPORT_SCHEMA,
        "verdict": own_verdict,
        "own_verdict": own_verdict,
        "setup": {
            "export": str(setup.export),
            "checkpoint": None if setup.checkpoint is None else str(setup.checkpoint),
            "base": None if setup.base is None else str(setup.base),
            "device": setup.options.device,
            "dtype": requested,
            "mode": setup.options.mode,
            "lora": manifest["lora"]["mode"],
            "threads": setup.threads,
            "runtime_options": setup.options.to_json(),
            "runtime_options_label": runtime_adapter.label(setup.options),
            "references": sorted(refs),
            "truth": truth,
        },
        "export_manifest_sha256": manifest_sha,
        "export": {"format": manifest.get("format"), "exporter": manifest.get("exporter"), "source": manifest.get("source"), "lora": manifest.get("lora")},
        "gate": gate.to_json(),
        "bounds": bounds,
        "distribution": distribution,
        "summary": report.summary(entries),
        "references": {
            dtype: {
                "origin": run.data.get("origin"),
                "environment": run.data["environment"],
                "checkpoint_sha256": run.data["checkpoint_sha256"],
                "checkpoint_config": run.data.get("checkpoint_config"),
                "build_seconds": run.data.get("build_seconds"),
                "process_seconds": run.seconds,
                "cached": run.cached,
            }
            for dtype, run in refs.items()
        },
        "runtime": runtime.environment | {"seconds": runtime.seconds},
        "requests": entries,
        "dual": None,
    }
