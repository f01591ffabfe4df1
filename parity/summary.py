"""A compact summary of one or more gate runs: `python -m parity.summary OUTDIR [OUTDIR ...]`.

Reads each OUTDIR/summary.json written by `parity.gate` and prints, per configuration, its verdict
and the three errors (max / mean / p95 of the per-question largest |Δp|: reference vs truth,
runtime vs truth, runtime vs reference), the gate's bound and the dual check; per negative control,
its verdict (each must be FAIL) and what caught it. `--markdown` prints the configuration table
in the form docs/parity.md uses. Exit 0 when every run passed, 1 otherwise, 2 when a summary is
missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _e(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _stat(summary: dict, column: str, key: str):
    stats = summary["errors"].get(column)
    return None if not stats else stats[key]


def rows(data: dict) -> list[dict]:
    out = []
    for name, c in data["configurations"].items():
        if c["verdict"] == "skipped":
            out.append({"name": name, "verdict": "skipped"})
            continue
        s, b = c["summary"], c["bounds"]
        row = {"name": name, "verdict": c["verdict"], "questions": s["questions"], "bound": b["per_option"], "kind": b["kind"],
               "decisions": f"{s['decisions_agree_where_gated']}/{s['decisions_gated']}"}
        for col in ("reference_vs_truth", "runtime_vs_truth", "runtime_vs_reference"):
            row[col] = tuple(_stat(s, col, k) for k in ("max", "mean", "p95"))
        d = c.get("dual")
        row["dual"] = None if d is None else (d["verdict"], _stat(d["summary"], "runtime_vs_reference", "max"), d["bounds"]["per_option"])
        row["dual_note"] = c.get("dual_note")
        dist = c.get("distribution") or {}
        row["distribution"] = "-" if "mean" not in dist else (
            f"mean {_e(dist['mean']['runtime'])}/{_e(dist['mean']['bound'])}, p95 {_e(dist['p95']['runtime'])}/{_e(dist['p95']['bound'])}"
            + ("" if dist.get("applied") else " (not gated)"))
        out.append(row)
    return out


def text(data: dict, label: str) -> str:
    lines = [f"== {label}: {data['requests']} requests, {data['questions']} questions, {data.get('seconds', 0):.0f} s"]
    for r in rows(data):
        if r["verdict"] == "skipped":
            lines.append(f"  SKIPPED {r['name']}")
            continue
        cols = "  ".join(f"{k.replace('_vs_', '-vs-').replace('reference', 'ref').replace('runtime', 'rt')} {_e(r[k][0])}/{_e(r[k][1])}/{_e(r[k][2])}"
                         for k in ("reference_vs_truth", "runtime_vs_truth", "runtime_vs_reference"))
        dual = "" if r["dual"] is None else f"; dual {r['dual'][0].upper()} {_e(r['dual'][1])} <= {_e(r['dual'][2])}"
        lines.append(f"  {r['verdict'].upper():4} {r['name']}: {cols} (max/mean/p95); {r['kind']} bound {_e(r['bound'])}; "
                     f"decisions {r['decisions']}; {r['distribution']}{dual}")
    for label_, c in data.get("controls", {}).items():
        mark = "ok" if c["verdict"] == "fail" else "NOT CAUGHT"
        lines.append(f"  control {label_}: gate {c['verdict'].upper()} ({mark}): {c['first_problem'][:140]}")
    for s in data.get("skipped", []):
        lines.append(f"  skipped: {s}")
    return "\n".join(lines)


def markdown(all_rows: list[dict]) -> str:
    head = ("| configuration | questions | ref vs truth max / mean / p95 | runtime vs truth max / mean / p95 | runtime vs ref max | gate bound | "
            "decisions agree (where gated) | dual: fp32 run vs its anchor / bound | verdict |")
    lines = [head, "| " + " | ".join(["---"] * 9) + " |"]
    for r in all_rows:
        if r["verdict"] == "skipped":
            lines.append(f"| {r['name']} | | | | | | | | skipped |")
            continue
        three = lambda k: " / ".join(_e(x) for x in r[k])  # noqa: E731
        dual = "-" if r["dual"] is None else f"{_e(r['dual'][1])} / {_e(r['dual'][2])}"
        lines.append(f"| {r['name']} | {r['questions']} | {three('reference_vs_truth')} | {three('runtime_vs_truth')} | {_e(r['runtime_vs_reference'][0])} | "
                     f"{r['kind']} {_e(r['bound'])} | {r['decisions']} | {dual} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.summary", description=__doc__.splitlines()[0])
    ap.add_argument("outdirs", type=Path, nargs="+")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    ok, all_rows = True, []
    for d in args.outdirs:
        path = d / "summary.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            print(f"error: {path}: no gate summary ({getattr(e, 'strerror', None) or e})", file=sys.stderr)
            return 2
        print(text(data, str(d)))
        all_rows += rows(data)
        ok = ok and not data.get("failed")
    if args.markdown:
        print(markdown(all_rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
