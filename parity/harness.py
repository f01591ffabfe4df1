"""Runtime-vs-reference comparison: run both sides on the same wire requests, compare, report.

- The reference runs in its own process (`parity.reference_worker`), rebuilt from the training
  checkpoint and the base; it returns its own prompt token ids, pixel values and FP32 logits.
- The runtime runs in this process through `valen_runtime.engine.Engine` on the export.
- Probabilities, confidence, score and decision are computed here from each side's logits with the
  same code (docs/valen-model.md), so only the logits can make them differ.
- Token ids, positions, keys, usage and image grids must be equal; pixel values and the numbers
  within the declared tolerance (`parity.tolerances`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from valen_runtime.safetensors_file import sha256_file

from . import isolation
from .tolerances import Tolerance

REPORT_SCHEMA = "valen-parity-report/1"
REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_FILES = ("isolation.py", "prompt.py", "reference.py", "reference_worker.py", "valen_source.py")


class UsageProblem(Exception):
    """Bad inputs (paths, unreadable export, reference cannot be built): exit 2, one line."""


# ---------------------------------------------------------------- §10 formulas (both sides)


def probabilities(logits: list[float] | torch.Tensor, temperature: float = 1.0) -> list[float]:
    """softmax(logits / T) in FP32, to Python floats, renormalised in float64 with a left-to-right sum."""
    t = logits if isinstance(logits, torch.Tensor) else torch.tensor(logits, dtype=torch.float32)
    values = (t.float().cpu() / temperature).softmax(-1).tolist()
    total = 0.0
    for v in values:
        total += v
    return [v / total for v in values]


def first_max(p: list[float]) -> int:
    best = 0
    for i in range(1, len(p)):
        if p[i] > p[best]:
            best = i
    return best


def answer_numbers(kind: str, p: list[float]) -> dict:
    """mode, confidence (choice/score), score (score) from probabilities."""
    k = len(p)
    mode = first_max(p)
    out = {"mode": mode, "confidence": None, "score": None}
    if kind == "choice":
        out["confidence"] = 1.0 if k == 1 else max(0.0, (max(p) - 1 / k) / (1 - 1 / k))
    elif kind == "score":
        out["score"] = sum(i * pi for i, pi in enumerate(p))
        distance = sum(pi * abs(i - mode) for i, pi in enumerate(p))
        uniform_mad = sum(abs(i - (k - 1) / 2) for i in range(k)) / k
        out["confidence"] = max(0.0, 1 - distance / uniform_mad)
    return out


def top_two_margin(p: list[float]) -> float | None:
    if len(p) < 2:
        return None
    s = sorted(p, reverse=True)
    return s[0] - s[1]


# ---------------------------------------------------------------- the reference side


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None




@dataclass
class ReferenceRun:
    data: dict
    out_dir: Path
    seconds: float
    cached: bool = False
    by_id: dict = field(default_factory=dict)

    def __post_init__(self):
        self.by_id = {r["id"]: r for r in self.data["results"]}

    def pixel_values(self, rid: str) -> torch.Tensor | None:
        rec = self.by_id[rid]
        name = rec.get("pixel_values_file")
        return None if name is None else torch.load(self.out_dir / name, map_location="cpu", weights_only=True)


def _check_inputs(checkpoint: Path, base: Path) -> None:
    for path, what in ((checkpoint / "checkpoint.pt", "checkpoint"), (checkpoint / "config.json", "checkpoint"), (base / "config.json", "base")):
        if not path.is_file():
            raise UsageProblem(f"{path}: missing; --{what} must be a Valen {what} folder")


def reference_cache_key(checkpoint: Path, base: Path, device: str, dtype: str, requests: list[tuple[str, dict]], valen_source: str | None, threads: int | None) -> str:
    h = hashlib.sha256()
    parts = {
        "checkpoint_sha256": sha256_file(checkpoint / "checkpoint.pt"),
        "checkpoint_config": (checkpoint / "config.json").read_text(encoding="utf-8"),
        "base_files": {p.name: sha256_file(p) if p.suffix != ".safetensors" else (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(base.iterdir()) if p.is_file()},
        "device": device,
        "dtype": dtype,
        "valen_source": valen_source,
        "threads": threads,
        "requests": [req for _, req in requests],  # ids are labels only: results are remapped by position
        # The code that runs in the reference process: a change to it invalidates cached results.
        "worker": {n: sha256_file(Path(__file__).resolve().parent / n) for n in WORKER_FILES},
    }
    h.update(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:32]


def run_reference(
    checkpoint: Path,
    base: Path,
    requests: list[tuple[str, dict]],
    device: str = "cpu",
    dtype: str = "bf16",
    workdir: Path | None = None,
    valen_source: str | None = None,
    threads: int | None = None,
    cache_dir: Path | None = None,
    timeout: float | None = None,
) -> ReferenceRun:
    """Build the reference once in a subprocess and run every request. `requests`: [(id, request)]."""
    checkpoint, base = Path(checkpoint), Path(base)
    _check_inputs(checkpoint, base)
    key = None
    if cache_dir is not None:
        key = reference_cache_key(checkpoint, base, device, dtype, requests, valen_source, threads)
        hit = Path(cache_dir) / key
        if (hit / "reference.json").is_file():
            data = json.loads((hit / "reference.json").read_text(encoding="utf-8"))
            for rec, (rid, _) in zip(data["results"], requests):
                rec["id"] = rid
            return ReferenceRun(data, hit, 0.0, cached=True)
    out = Path(tempfile.mkdtemp(prefix="valen-parity-ref-", dir=workdir))
    try:  # the caller removes `out` after comparing; here only when the reference fails or is interrupted
        return _reference_in(out, checkpoint, base, requests, device, dtype, valen_source, threads, cache_dir, key, timeout)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _reference_in(out: Path, checkpoint: Path, base: Path, requests, device, dtype, valen_source, threads, cache_dir, key, timeout) -> ReferenceRun:
    job = {
        "checkpoint": str(checkpoint.resolve()),
        "base": str(base.resolve()),
        "device": device,
        "dtype": dtype,
        "out": str(out),
        "valen_source": valen_source,
        "threads": threads,
        "requests": [{"id": rid, "request": req} for rid, req in requests],
    }
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job, ensure_ascii=False), encoding="utf-8")
    env = isolation.clean_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "parity.reference_worker", str(job_path)],
            env=env,
            cwd=str(REPO_ROOT),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise UsageProblem(f"reference process did not finish within {timeout} s") from None
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("reference failed:")]
        detail = lines[-1] if lines else (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UsageProblem(f"{detail.removeprefix('reference failed: ')} (reference process exit {proc.returncode})")
    data = json.loads((out / "reference.json").read_text(encoding="utf-8"))
    if cache_dir is not None:
        dest = Path(cache_dir) / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            shutil.copytree(out, dest)
    return ReferenceRun(data, out, seconds)


# ---------------------------------------------------------------- the runtime side


def runtime_environment(engine, threads: int | None) -> dict:
    import valen_runtime

    return {
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "tokenizers": _dist_version("tokenizers"), "pillow": _dist_version("pillow"), "valen_runtime": _dist_version("valen-native")},
        "runtime_package": str(Path(valen_runtime.__file__).resolve().parent),
        "transformers_imported": "transformers" in sys.modules,
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "mode": engine.mode,
        "tf32": {"cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32), "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32)},
        "torch_num_threads": torch.get_num_threads(),
        # What the engine runs at its seams: {"gated_delta": "torch" | "fla-core X", "attention": "eager" | "sdpa"}.
        "kernels": dict(getattr(engine, "kernels", None) or {"gated_delta": "torch", "attention": "eager"}),
        "cuda_graphs": getattr(engine, "graphs", None) is not None,
    }


# ---------------------------------------------------------------- comparison


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"differ at index {i}: reference {x!r}, runtime {y!r} (lengths {len(a)}/{len(b)})"
    return f"lengths differ: reference {len(a)}, runtime {len(b)}"


def compare_tokens(ref_prompt: dict, compiled) -> list[str]:
    """Every token id, position and key must be equal; returns the differences (empty = equal)."""
    problems = []
    st = compiled.state
    if ref_prompt["input_ids"] != list(st.input_ids):
        problems.append("state.input_ids " + _first_difference(ref_prompt["input_ids"], list(st.input_ids)))
    ref_types = ref_prompt.get("mm_token_type_ids")
    if ref_types is not None and ref_types != list(st.mm_token_type_ids):
        problems.append("state.mm_token_type_ids " + _first_difference(ref_types, list(st.mm_token_type_ids)))
    rt_grid = None if st.image_grid_thw is None else st.image_grid_thw.tolist()
    if ref_prompt.get("image_grid_thw") != rt_grid:
        problems.append(f"state.image_grid_thw: reference {ref_prompt.get('image_grid_thw')}, runtime {rt_grid}")
    rq_list, cq_list = ref_prompt["questions"], compiled.questions
    if [q["qid"] for q in rq_list] != [q.qid for q in cq_list]:
        problems.append(f"question order: reference {[q['qid'] for q in rq_list]}, runtime {[q.qid for q in cq_list]}")
        return problems
    for rq, cq in zip(rq_list, cq_list):
        where = f"questions.{rq['qid']}"
        if rq["kind"] != cq.kind:
            problems.append(f"{where}.kind: reference {rq['kind']!r}, runtime {cq.kind!r}")
        if rq["keys"] != list(cq.keys):
            problems.append(f"{where}.keys: reference {rq['keys']}, runtime {list(cq.keys)}")
        if rq["descriptions"] != list(cq.descriptions):
            problems.append(f"{where}.descriptions " + _first_difference(rq["descriptions"], list(cq.descriptions)))
        if len(rq["branches"]) != len(cq.branches):
            problems.append(f"{where}: reference {len(rq['branches'])} branches, runtime {len(cq.branches)}")
            continue
        for b, (rb, cb) in enumerate(zip(rq["branches"], cq.branches)):
            if rb["suffix_ids"] != list(cb.suffix_ids):
                problems.append(f"{where}.branches[{b}].suffix_ids " + _first_difference(rb["suffix_ids"], list(cb.suffix_ids)))
            if rb["candidate_positions"] != list(cb.candidate_positions):
                problems.append(f"{where}.branches[{b}].candidate_positions: reference {rb['candidate_positions']}, runtime {list(cb.candidate_positions)}")
            if rb["decision_position"] != cb.decision_position:
                problems.append(f"{where}.branches[{b}].decision_position: reference {rb['decision_position']}, runtime {cb.decision_position}")
    return problems


def compare_usage(ref_prompt: dict, response: dict, compiled) -> list[str]:
    problems = []
    want = {"input_tokens": ref_prompt["logical_tokens"], "output_tokens": 0}
    if response.get("usage") != want:
        problems.append(f"usage: reference {want}, runtime {response.get('usage')}")
    want_internal = {"compute_tokens": ref_prompt["compute_tokens"]}
    if response.get("internal_usage") != want_internal:
        problems.append(f"internal_usage: reference {want_internal}, runtime {response.get('internal_usage')}")
    if (compiled.logical_tokens, compiled.compute_tokens) != (ref_prompt["logical_tokens"], ref_prompt["compute_tokens"]):
        problems.append(f"compiled tokens: reference {ref_prompt['logical_tokens']}/{ref_prompt['compute_tokens']}, runtime {compiled.logical_tokens}/{compiled.compute_tokens}")
    return problems


def _answer_formula_delta(kind: str, keys: list[str], descriptions: list[str], p_rt: list[float], nums: dict, given: dict) -> tuple[float, list[str]]:
    """Compare the runtime's response answer with §10 applied to the runtime's own logits."""
    problems = []
    delta = 0.0
    if kind == "noul":
        if list(given) != ["type", "noul"] or given.get("type") != "noul":
            problems.append(f"noul answer keys {list(given)}; expected ['type', 'noul']")
            return math.inf, problems
        return abs(given["noul"] - p_rt[keys.index("true")]), problems
    probs = given.get("probabilities")
    if not isinstance(probs, dict) or list(probs) != keys:
        problems.append(f"probabilities keys {list(probs) if isinstance(probs, dict) else probs}; expected {keys} in that order")
        return math.inf, problems
    delta = max(abs(probs[k] - p) for k, p in zip(keys, p_rt))
    delta = max(delta, abs(given.get("confidence", math.inf) - nums["confidence"]))
    if kind == "choice":
        if given.get("choice") != keys[nums["mode"]]:
            problems.append(f"choice {given.get('choice')!r}; its own probabilities give {keys[nums['mode']]!r}")
        expected_keys = ["type", "probabilities", "choice", "confidence"]
    else:
        delta = max(delta, abs(given.get("score", math.inf) - nums["score"]))
        if given.get("legend") != dict(zip(keys, descriptions)):
            problems.append("score legend differs from the compiled descriptions")
        expected_keys = ["type", "probabilities", "score", "legend", "confidence"]
    if list(given) != expected_keys:
        problems.append(f"answer keys {list(given)}; Valen's order is {expected_keys}")
    return delta, problems


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.2e}" if isinstance(x, float) else str(x)


def compare_request(case: str, name: str, ref: dict, ref_pixels, rt, rt_error: str | None, tol: Tolerance) -> dict:
    """One request's report entry. `rt` is a RunResult or None (then rt_error says why)."""
    entry = {"case": case, "name": name, "checks": {}, "questions": [], "problems": []}
    if not ref["ok"] or rt is None:
        if not ref["ok"] and rt is None:
            entry["verdict"] = "pass"
            entry["note"] = f"rejected by both: reference {ref['error']}; runtime {rt_error}"
        else:
            entry["verdict"] = "fail"
            entry["problems"].append(f"reference {'rejected: ' + ref['error'] if not ref['ok'] else 'accepted'}; runtime {'rejected: ' + rt_error if rt is None else 'accepted'}")
        return entry
    prompt = ref["prompt"]
    compiled = rt.compiled
    token_problems = compare_tokens(prompt, compiled)
    entry["checks"]["token_ids"] = {"ok": not token_problems, "problems": token_problems}
    usage_problems = compare_usage(prompt, rt.response, compiled)
    entry["checks"]["usage"] = {"ok": not usage_problems, "problems": usage_problems, "runtime": rt.response.get("usage"), "runtime_internal": rt.response.get("internal_usage")}
    rt_px = compiled.state.pixel_values
    if ref_pixels is not None or rt_px is not None:
        if ref_pixels is None or rt_px is None or tuple(ref_pixels.shape) != tuple(rt_px.shape):
            px = {"ok": False, "max_abs": None, "problems": [f"pixel_values shape: reference {None if ref_pixels is None else list(ref_pixels.shape)}, runtime {None if rt_px is None else list(rt_px.shape)}"]}
        else:
            d = (ref_pixels.float() - rt_px.float().cpu()).abs().max().item()
            px = {"ok": d <= tol.pixel_values_max_abs, "max_abs": d, "shape": list(ref_pixels.shape), "problems": [] if d <= tol.pixel_values_max_abs else [f"pixel_values max |Δ| {d:.3g} > {tol.pixel_values_max_abs:g}"]}
        entry["checks"]["pixel_values"] = px

    formula_max = 0.0
    formula_problems: list[str] = []
    rt_answers = rt.response.get("answers", {})
    for i, rq in enumerate(prompt["questions"]):
        q = {"qid": rq["qid"], "kind": rq["kind"], "keys": rq["keys"]}
        ref_logits = ref["logits"][i]
        rt_logits = [float(x) for x in rt.logits[i].float().tolist()] if i < len(rt.logits) else []
        q["logits_ref"], q["logits_runtime"] = ref_logits, rt_logits
        if len(rt_logits) != len(ref_logits):
            q.update(verdict="fail", problems=[f"runtime returned {len(rt_logits)} logits, reference {len(ref_logits)}"])
            entry["questions"].append(q)
            continue
        p_ref, p_rt = probabilities(ref_logits), probabilities(rt_logits)
        n_ref, n_rt = answer_numbers(rq["kind"], p_ref), answer_numbers(rq["kind"], p_rt)
        dp = [b - a for a, b in zip(p_ref, p_rt)]
        margin = top_two_margin(p_ref)
        q.update(
            p_ref=p_ref,
            p_runtime=p_rt,
            dp=dp,
            max_abs_dp=max(abs(x) for x in dp),
            max_abs_dlogit=max(abs(a - b) for a, b in zip(ref_logits, rt_logits)),
            confidence_ref=n_ref["confidence"],
            confidence_runtime=n_rt["confidence"],
            abs_dconfidence=None if n_ref["confidence"] is None else abs(n_ref["confidence"] - n_rt["confidence"]),
            score_ref=n_ref["score"],
            score_runtime=n_rt["score"],
            abs_dscore=None if n_ref["score"] is None else abs(n_ref["score"] - n_rt["score"]),
            decision_ref=rq["keys"][n_ref["mode"]],
            decision_runtime=rq["keys"][n_rt["mode"]],
            margin=margin,
        )
        q["decision_agree"] = q["decision_ref"] == q["decision_runtime"]
        q["decision_gated"] = margin is None or margin >= tol.decision_margin
        problems = []
        if q["max_abs_dp"] > tol.max_abs_dp:
            problems.append(f"max |Δp| {q['max_abs_dp']:.3g} > {tol.max_abs_dp:g}")
        if q["abs_dconfidence"] is not None and q["abs_dconfidence"] > tol.max_abs_dconfidence:
            problems.append(f"|Δconfidence| {q['abs_dconfidence']:.3g} > {tol.max_abs_dconfidence:g}")
        if q["abs_dscore"] is not None and q["abs_dscore"] > tol.max_abs_dscore:
            problems.append(f"|Δscore| {q['abs_dscore']:.3g} > {tol.max_abs_dscore:g}")
        if q["decision_gated"] and not q["decision_agree"]:
            problems.append(f"decision {q['decision_runtime']!r} != reference {q['decision_ref']!r} at margin {_fmt(margin)} >= {tol.decision_margin:g}")
        given = rt_answers.get(rq["qid"])
        if given is None:
            formula_problems.append(f"{rq['qid']}: no answer in the runtime response")
        else:
            d, probs = _answer_formula_delta(rq["kind"], rq["keys"], rq["descriptions"], p_rt, n_rt, given)
            formula_max = max(formula_max, d)
            formula_problems += [f"{rq['qid']}: {p}" for p in probs]
        q["problems"] = problems
        q["verdict"] = "pass" if not problems else "fail"
        entry["questions"].append(q)
    if list(rt_answers) != [q["qid"] for q in prompt["questions"]]:
        formula_problems.append(f"response answers order {list(rt_answers)}; expected {[q['qid'] for q in prompt['questions']]}")
    if formula_max > tol.answer_formula_max_abs:
        formula_problems.append(f"response numbers differ from §10 on the runtime's own logits by {formula_max:.3g} > {tol.answer_formula_max_abs:g}")
    entry["checks"]["answer_formula"] = {"ok": not formula_problems, "max_abs": formula_max if math.isfinite(formula_max) else None, "problems": formula_problems}
    for name_, check in entry["checks"].items():
        entry["problems"] += [f"{name_}: {p}" for p in check["problems"]]
    bad_q = [q for q in entry["questions"] if q["verdict"] != "pass"]
    entry["verdict"] = "pass" if not entry["problems"] and not bad_q else "fail"
    entry["runtime_timings"] = rt.timings
    entry["reference_seconds"] = ref.get("seconds")
    return entry


# ---------------------------------------------------------------- a whole run


@dataclass
class Setup:
    export: Path
    checkpoint: Path
    base: Path
    device: str = "cpu"
    dtype: str = "bf16"
    mode: str = "per-branch"
    valen_source: str | None = None
    threads: int | None = None
    # Passed to Engine.load when set (None = the engine's own default for the device and mode).
    kernels: str | None = None
    graphs: bool | None = None
    lora_gemm: str | None = None
    layout: str | None = None  # shared-prefix layout: "batch" | "packed" | "one-pass" (Engine's layout)


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


def evaluate(setup: Setup, requests: list[tuple[str, str, dict]], ref: ReferenceRun, tol: Tolerance, manifest: dict, manifest_sha: str, engine=None) -> dict:
    """Run the runtime on every request and compare with the reference run. Returns the report."""
    from valen_runtime.engine import Engine
    from valen_runtime.errors import RequestError, ValenError

    if engine is None:
        options = {k: v for k, v in (("kernels", setup.kernels), ("graphs", setup.graphs), ("lora_gemm", setup.lora_gemm),
                                     ("layout", setup.layout)) if v is not None}
        try:
            engine = Engine.load(setup.export, device=setup.device, dtype=setup.dtype, verify="size", mode=setup.mode, **options)
        except (ValenError, OSError, ValueError, TypeError) as e:
            raise UsageProblem(f"runtime could not load {setup.export}: {e}") from None
    entries = []
    for case, name, req in requests:
        rid = f"{case}/{name}"
        rt, err = None, None
        try:
            rt = engine.run(req)
        except RequestError as e:
            err = f"RequestError: {e}"
        except Exception as e:  # a runtime crash on a request is a parity failure, reported per request
            entry = compare_request(case, name, ref.by_id[rid], None, None, f"{type(e).__name__}: {e}", tol)
            entry["verdict"] = "fail"
            entry["problems"] = [f"runtime raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
            entry["runtime_exception"] = traceback.format_exception_only(type(e), e)[-1].strip()
            entries.append(entry)
            continue
        entries.append(compare_request(case, name, ref.by_id[rid], ref.pixel_values(rid), rt, err, tol))
    return build_report(setup, entries, ref, tol, manifest, manifest_sha, runtime_environment(engine, setup.threads))


def _max(values):
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def build_report(setup: Setup, entries: list[dict], ref: ReferenceRun, tol: Tolerance, manifest: dict, manifest_sha: str, rt_env: dict) -> dict:
    qs = [q for e in entries for q in e["questions"] if "max_abs_dp" in q]
    px = [e["checks"]["pixel_values"]["max_abs"] for e in entries if "pixel_values" in e["checks"]]
    failures = [e for e in entries if e["verdict"] != "pass"]
    summary = {
        "requests": len(entries),
        "questions": len(qs),
        "failed_requests": len(failures),
        "failed_questions": sum(1 for e in entries for q in e["questions"] if q.get("verdict") != "pass"),
        "max_abs_dp": _max(q["max_abs_dp"] for q in qs),
        "max_abs_dconfidence": _max(q["abs_dconfidence"] for q in qs),
        "max_abs_dscore": _max(q["abs_dscore"] for q in qs),
        "max_abs_dlogit": _max(q["max_abs_dlogit"] for q in qs),
        "min_margin": min((q["margin"] for q in qs if q["margin"] is not None), default=None),
        "decisions_agree": sum(1 for q in qs if q["decision_agree"]),
        "decisions_gated": sum(1 for q in qs if q["decision_gated"]),
        "token_ids_equal": sum(1 for e in entries if e["checks"].get("token_ids", {}).get("ok")),
        "usage_equal": sum(1 for e in entries if e["checks"].get("usage", {}).get("ok")),
        "max_pixel_values_abs": _max(px),
        "max_answer_formula_abs": _max(e["checks"]["answer_formula"]["max_abs"] for e in entries if "answer_formula" in e["checks"]),
    }
    return {
        "schema": REPORT_SCHEMA,
        "verdict": "pass" if not failures else "fail",
        "setup": {
            "export": str(setup.export),
            "checkpoint": str(setup.checkpoint),
            "base": str(setup.base),
            "device": setup.device,
            "dtype": setup.dtype,
            "mode": setup.mode,
            "lora": manifest["lora"]["mode"],
            "threads": setup.threads,
            "engine_options": {"kernels": setup.kernels, "graphs": setup.graphs, "lora_gemm": setup.lora_gemm, "layout": setup.layout},
        },
        "export_manifest_sha256": manifest_sha,
        "export": {"format": manifest.get("format"), "exporter": manifest.get("exporter"), "source": manifest.get("source"), "lora": manifest.get("lora")},
        "tolerance": tol.to_json(),
        "summary": summary,
        "reference": {
            "origin": ref.data.get("origin"),
            "environment": ref.data["environment"],
            "checkpoint_sha256": ref.data["checkpoint_sha256"],
            "checkpoint_config": ref.data.get("checkpoint_config"),
            "build_seconds": ref.data.get("build_seconds"),
            "process_seconds": ref.seconds,
            "cached": ref.cached,
        },
        "runtime": rt_env,
        "requests": entries,
    }


# ---------------------------------------------------------------- the table


def table(report: dict) -> str:
    rows = [("case", "question", "decision ref/runtime", "max |Δp|", "margin", "verdict")]
    for e in report["requests"]:
        label = f"{e['case']}/{e['name']}"
        if not e["questions"]:
            rows.append((label, "-", "-", "-", "-", e["verdict"].upper() if e["verdict"] == "fail" else "ok (" + e.get("note", "")[:40] + ")"))
        for q in e["questions"]:
            verdict = "ok" if q.get("verdict") == "pass" else "FAIL: " + "; ".join(q.get("problems", []))
            rows.append((label, q["qid"], f"{q.get('decision_ref', '-')}/{q.get('decision_runtime', '-')}", _fmt(q.get("max_abs_dp")), _fmt(q.get("margin")), verdict))
        for p in e["problems"]:
            rows.append((label, "(request)", "-", "-", "-", "FAIL: " + p))
    widths = [min(max(len(r[i]) for r in rows), 40) for i in range(5)]
    lines = ["  ".join(c.ljust(w)[: max(w, len(c)) if i == 0 else w] for i, (c, w) in enumerate(zip(r[:5], widths))) + "  " + r[5] for r in rows]
    s = report["summary"]
    setup = report["setup"]
    lines.append(
        f"{setup['lora']} lora, {setup['dtype']}, {setup['device']}, {setup['mode']}: "
        f"{s['requests'] - s['failed_requests']}/{s['requests']} requests pass; max |Δp| {_fmt(s['max_abs_dp'])}, "
        f"max |Δconf| {_fmt(s['max_abs_dconfidence'])}, max |Δscore| {_fmt(s['max_abs_dscore'])}, max |Δlogit| {_fmt(s['max_abs_dlogit'])}; "
        f"tolerance max |Δp| {report['tolerance']['max_abs_dp']:g} ({report['tolerance']['status']}) -> {report['verdict'].upper()}"
    )
    return "\n".join(lines)
