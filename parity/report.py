"""The report: JSON (`valen-parity-report/2`) and the printed table.

Per question the report carries every side's logits and probabilities and three errors side by
side (max over options of |Δp|): reference vs truth, runtime vs truth, runtime vs reference. The
truth is the fp32 reference; for fp32 runs on the CPU it is the fp64 reference when one ran (the
fp32 reference is then the requested one).
"""

from __future__ import annotations

import math
import statistics

from .answers import abs_errors
from .compare import mean, measured_questions, p95

REPORT_SCHEMA = "valen-parity-report/2"
ERRORS = ("reference_vs_truth", "runtime_vs_truth", "runtime_vs_reference")


def truth_dtype(requested: str, references: list[str]) -> str:
    """The truth the three error columns use: fp64 for fp32 runs when it ran, else fp32."""
    return "fp64" if requested == "fp32" and "fp64" in references else "fp32"


def add_error_columns(entries: list[dict], requested: str, truth: str) -> None:
    """Per question: the three per-option error lists and their maxima."""
    for q in measured_questions(entries):
        p = q["p"]
        per_option = {
            "reference_vs_truth": abs_errors(p[requested], p[truth]),
            "runtime_vs_truth": abs_errors(p["runtime"], p[truth]),
            "runtime_vs_reference": abs_errors(p["runtime"], p[requested]),
        }
        q["errors_per_option"] = per_option
        q["errors"] = {k: max(v) for k, v in per_option.items()}
        q["max_abs_dlogit"] = max(abs(a - b) for a, b in zip(q["logits"]["runtime"], q["logits"][requested]))
        for key in ("confidence", "score"):
            a, b = q[key]["runtime"], q[key][requested]
            q[f"abs_d{key}"] = None if a is None else abs(a - b)


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"max": max(values), "mean": mean(values), "median": statistics.median(values), "p95": p95(values)}


def _max(values):
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def summary(entries: list[dict]) -> dict:
    qs = measured_questions(entries)
    judged = [q for q in qs if "verdict" in q]
    checks = lambda name: [e["checks"][name] for e in entries if name in e["checks"]]  # noqa: E731
    return {
        "requests": len(entries),
        "questions": len(qs),
        "failed_requests": sum(1 for e in entries if e["verdict"] != "pass"),
        "failed_questions": sum(1 for e in entries for q in e["questions"] if q.get("verdict") != "pass"),
        # over questions with two or more candidates (one candidate: p = 1 on every side)
        "errors": {k: _stats([q["errors"][k] for q in qs if len(q["keys"]) > 1]) for k in ERRORS},
        "max_judged_error": _max(q.get("judged_error") for q in qs),
        "max_abs_dlogit": _max(q["max_abs_dlogit"] for q in qs),
        "max_abs_dconfidence": _max(q["abs_dconfidence"] for q in qs),
        "max_abs_dscore": _max(q["abs_dscore"] for q in qs),
        "decisions_gated": sum(1 for q in judged if q["decision_gated"]),
        "decisions_agree": sum(1 for q in judged if q["decision_agree"]),
        "decisions_agree_where_gated": sum(1 for q in judged if q["decision_gated"] and q["decision_agree"]),
        "token_ids_equal": sum(1 for c in checks("token_ids") if c["ok"]),
        "usage_equal": sum(1 for c in checks("usage") if c["ok"]),
        "rotary_equal": sum(1 for c in checks("rotary") if c["ok"]),
        "max_pixel_values_abs": _max(c["max_abs"] for c in checks("pixel_values")),
        "max_pixel_values_videos_abs": _max(c["max_abs"] for c in checks("pixel_values_videos")),
        "max_rotary_abs": _max(c["max_abs"] for c in checks("rotary")),
        "max_answer_formula_abs": _max(c["max_abs"] for c in checks("answer_formula")),
    }


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.2e}" if isinstance(x, float) else str(x)


def summary_line(report: dict) -> str:
    s, setup, b = report["summary"], report["setup"], report["bounds"]
    e = s["errors"]
    col = lambda k: _fmt(e[k]["max"]) if e[k] else "-"  # noqa: E731
    dist = report["distribution"]
    dist_text = ""
    if dist.get("applied"):
        dist_text = f"; mean {_fmt(dist['mean']['runtime'])} <= {_fmt(dist['mean']['bound'])}, p95 {_fmt(dist['p95']['runtime'])} <= {_fmt(dist['p95']['bound'])}"
    line = (
        f"{setup['lora']} lora, {setup['device']}, {setup['runtime_options_label']}: "
        f"{s['requests'] - s['failed_requests']}/{s['requests']} requests pass; max |Δp| reference vs truth ({setup['truth']}) {col('reference_vs_truth')}, "
        f"runtime vs truth {col('runtime_vs_truth')}, runtime vs reference {col('runtime_vs_reference')}; "
        f"{b['kind']} gate: {b['judged']} <= {_fmt(b['per_option'])} per option{dist_text} -> {report['own_verdict'].upper()}"
    )
    if report.get("dual") is not None:
        line += "\n  dual " + summary_line(report["dual"]).replace("\n  ", "\n    ")
    if report["verdict"] != report["own_verdict"]:
        line += f"\n  -> {report['verdict'].upper()}"
    return line


def table(report: dict) -> str:
    """One row per question: decisions, the three errors, the truth's margin, the verdict."""
    header = ("case", "question", "decision truth/ref/runtime", "ref-vs-truth", "rt-vs-truth", "rt-vs-ref", "truth margin", "verdict")
    rows = [header]
    truth, requested = report["setup"]["truth"], report["setup"]["dtype"]
    for e in report["requests"]:
        label = f"{e['case']}/{e['name']}"
        if not e["questions"]:
            rows.append((label, "-", "-", "-", "-", "-", "-", "FAIL" if e["verdict"] == "fail" else "ok (" + e.get("note", "")[:40] + ")"))
        for q in e["questions"]:
            verdict = "ok" if q.get("verdict") == "pass" else "FAIL: " + "; ".join(q.get("problems", []))
            err = q.get("errors", {})
            d = q.get("decision", {})
            decisions = f"{d.get(truth, '-')}/{d.get(requested, '-')}/{d.get('runtime', '-')}"
            rows.append((label, q["qid"], decisions, _fmt(err.get("reference_vs_truth")), _fmt(err.get("runtime_vs_truth")),
                         _fmt(err.get("runtime_vs_reference")), _fmt(q.get("margin", {}).get(truth)), verdict))
        for p in e["problems"]:
            rows.append((label, "(request)", "-", "-", "-", "-", "-", "FAIL: " + p))
    dist = report["distribution"]
    for p in dist.get("problems", []):
        rows.append(("(set)", "distribution", "-", "-", "-", "-", "-", "FAIL: " + p))
    widths = [min(max(len(r[i]) for r in rows), 40) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w)[:w] for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    if report.get("dual") is not None:
        lines.append("dual (fp32) run of the same runtime options:")
        lines += ["  " + ln for ln in table(report["dual"]).splitlines()[:-1]]
    lines.append(summary_line(report))
    return "\n".join(lines)
