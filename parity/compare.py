"""Comparison maths: one runtime run against the reference runs, judged by its declared gate.

Three steps, each a function:
1. `measure_request`: the exact checks of one request (token ids, usage, pixel values of images
   and videos, rotary tables, the runtime's answer JSON against Valen's formulas on its own logits) and, per question,
   the probabilities of every side (runtime, and the reference in each dtype that ran).
2. `gate_bounds`: the numbers the gate compares against, from the declared parameters and, for
   the fp32-rounding and truth-relative gates, the bf16 reference's own error on the same requests.
3. `judge`: every per-option, decision and distribution rule; a value passes when it is `<=` its
   bound, a decision is checked when the margin is `>=` its threshold (tests/parity/test_units.py
   holds both at the boundary).
"""

from __future__ import annotations

import math

from .answers import abs_errors, answer_numbers, probabilities, top_two_margin
from .tolerances import Gate

U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits, round to nearest)
U_FP32 = 2.0**-24  # unit roundoff of fp32 (24 significant bits)


def within(value: float, bound: float) -> bool:
    """The one comparison of a measured value with its bound: the bound itself passes."""
    return value <= bound


def gated(margin: float | None, threshold: float) -> bool:
    """Whether a decision is checked: one-candidate questions always, otherwise from the threshold on."""
    return margin is None or margin >= threshold


def p95(values: list[float]) -> float:
    """95th percentile by nearest rank: the ceil(0.95 n)-th smallest value."""
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def fp32_rounding_bound(gate: Gate, bf16_error: float) -> float:
    """max(floor, factor * u_fp32 / u_bf16 * E_bf16): the bf16 reference's measured error (how this
    model amplifies a rounding) scaled down to fp32's unit roundoff, `factor` fp32 roundings per
    bf16 one (docs/parity.md)."""
    return max(gate["floor"], gate["factor"] * (U_FP32 / U_BF16) * bf16_error)


def distribution_factor(gate: Gate, questions: int, spread: float = 1.0) -> float:
    """1 + z * spread * sqrt(2 / n): z standard errors of the ratio of two estimates from n errors
    each, `spread` the estimate's relative standard error times sqrt(n) (1 for the mean of errors
    whose standard deviation is their mean; gate["p95_spread"] for the p95)."""
    return 1 + gate["z"] * spread * math.sqrt(2 / questions)


# ---------------------------------------------------------------- exact checks of one request


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
    rt_video_grid = None if st.video_grid_thw is None else st.video_grid_thw.tolist()
    if ref_prompt.get("video_grid_thw") != rt_video_grid:
        problems.append(f"state.video_grid_thw: reference {ref_prompt.get('video_grid_thw')}, runtime {rt_video_grid}")
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


def compare_tensor(name: str, ref, rt, bound: float) -> dict:
    """max |Δ| of two CPU tensors of the same shape against `bound` (a shape difference fails)."""
    if ref is None or rt is None or tuple(ref.shape) != tuple(rt.shape):
        shapes = f"reference {None if ref is None else list(ref.shape)}, runtime {None if rt is None else list(rt.shape)}"
        return {"ok": False, "max_abs": None, "problems": [f"{name} shape: {shapes}"]}
    d = (ref.double() - rt.double()).abs().max().item() if ref.numel() else 0.0
    ok = within(d, bound)
    return {"ok": ok, "max_abs": d, "shape": list(ref.shape), "problems": [] if ok else [f"{name} max |Δ| {d:.3g} > {bound:g}"]}


def compare_rotary(ref: dict | None, rt: dict | None, bound: float) -> dict:
    """Position ids exactly, cos / sin tables within `bound`, for the request's first branch."""
    if ref is None or rt is None:
        missing = "reference" if ref is None else "runtime"
        return {"ok": False, "max_abs": None, "problems": [f"rotary tables: none from the {missing}"]}
    if not (ref["positions"].shape == rt["positions"].shape and bool((ref["positions"] == rt["positions"]).all())):
        return {"ok": False, "max_abs": None, "problems": [f"position ids differ (reference {list(ref['positions'].shape)}, runtime {list(rt['positions'].shape)})"]}
    return compare_tensor("rotary cos/sin", ref["tables"], rt["tables"], bound)


def _answer_formula_delta(kind: str, keys: list[str], descriptions: list[str], p_rt: list[float], nums: dict, given: dict) -> tuple[float, list[str]]:
    """Compare the runtime's response answer with Valen's formulas applied to the runtime's own logits."""
    problems = []
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


def measure_request(case: str, name: str, refs: dict, requested: str, outcome, gate: Gate, ref_pixels=None, ref_rotary=None,
                    temperature: float = 1.0, ref_pixels_videos=None) -> dict:
    """One request's report entry before the numeric gate: the exact checks and, per question,
    every side's logits and probabilities. `refs`: {dtype: reference record}; `outcome`: the
    runtime's (parity.runtime_adapter.Outcome); `temperature`: the runtime's, at which every
    side's probabilities are taken (Valen's calibration: softmax(logits / T)), so a runtime that
    ignores or misapplies its temperature fails the answer-formula check."""
    ref = refs[requested]
    rt = outcome.result
    entry = {"case": case, "name": name, "checks": {}, "questions": [], "problems": []}
    if not ref["ok"] or rt is None:
        rt_error = outcome.rejected or outcome.crashed
        if not ref["ok"] and outcome.rejected is not None:
            entry["verdict"] = "pass"
            entry["note"] = f"rejected by both: reference {ref['error']}; runtime {outcome.rejected}"
        elif outcome.crashed is not None:
            entry["verdict"] = "fail"
            entry["problems"].append(f"runtime raised {outcome.crashed}")
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
        entry["checks"]["pixel_values"] = compare_tensor("pixel_values", ref_pixels, None if rt_px is None else rt_px.cpu(), gate.pixel_values_max_abs)
    rt_video_px = compiled.state.pixel_values_videos  # the processor's pixel_values_videos, computed on the CPU
    if ref_pixels_videos is not None or rt_video_px is not None:
        entry["checks"]["pixel_values_videos"] = compare_tensor("pixel_values_videos", ref_pixels_videos, rt_video_px, gate.pixel_values_max_abs)
    entry["checks"]["rotary"] = compare_rotary(ref_rotary, outcome.rotary, gate.rotary_max_abs)

    formula_max = 0.0
    formula_problems: list[str] = []
    rt_answers = rt.response.get("answers", {})
    for i, rq in enumerate(prompt["questions"]):
        q = {"qid": rq["qid"], "kind": rq["kind"], "keys": rq["keys"], "logits": {}, "p": {}}
        rt_logits = [float(x) for x in rt.logits[i].float().tolist()] if i < len(rt.logits) else []
        counts = {dtype: len(rec["logits"][i]) for dtype, rec in refs.items()}
        if any(c != len(rt_logits) for c in counts.values()):
            q.update(verdict="fail", problems=[f"runtime returned {len(rt_logits)} logits, reference {counts}"])
            entry["questions"].append(q)
            continue
        for dtype, rec in refs.items():
            q["logits"][dtype] = rec["logits"][i]
            q["p"][dtype] = probabilities(rec["logits"][i], temperature)
        q["logits"]["runtime"], q["p"]["runtime"] = rt_logits, probabilities(rt_logits, temperature)
        numbers = {side: answer_numbers(rq["kind"], p) for side, p in q["p"].items()}
        q["decision"] = {side: rq["keys"][n["mode"]] for side, n in numbers.items()}
        q["margin"] = {side: top_two_margin(p) for side, p in q["p"].items() if side != "runtime"}
        q["confidence"] = {side: n["confidence"] for side, n in numbers.items()}
        q["score"] = {side: n["score"] for side, n in numbers.items()}
        given = rt_answers.get(rq["qid"])
        if given is None:
            formula_problems.append(f"{rq['qid']}: no answer in the runtime response")
        else:
            d, probs = _answer_formula_delta(rq["kind"], rq["keys"], rq["descriptions"], q["p"]["runtime"], numbers["runtime"], given)
            formula_max = max(formula_max, d)
            formula_problems += [f"{rq['qid']}: {p}" for p in probs]
        entry["questions"].append(q)
    if list(rt_answers) != [q["qid"] for q in prompt["questions"]]:
        formula_problems.append(f"response answers order {list(rt_answers)}; expected {[q['qid'] for q in prompt['questions']]}")
    if not within(formula_max, gate.answer_formula_max_abs):
        formula_problems.append(f"response numbers differ from Valen's formulas on the runtime's own logits by {formula_max:.3g} > {gate.answer_formula_max_abs:g}")
    entry["checks"]["answer_formula"] = {"ok": not formula_problems, "max_abs": formula_max if math.isfinite(formula_max) else None, "problems": formula_problems}
    for check_name, check in entry["checks"].items():
        entry["problems"] += [f"{check_name}: {p}" for p in check["problems"]]
    entry["runtime_timings"] = rt.timings
    entry["reference_seconds"] = ref.get("seconds")
    return entry


# ---------------------------------------------------------------- the gate


def measured_questions(entries: list[dict]) -> list[dict]:
    """Questions that have probabilities on every side (not failed structurally)."""
    return [q for e in entries for q in e["questions"] if "runtime" in q.get("p", {})]


def bf16_error(refs: dict, ids: list[str], temperature: float = 1.0) -> float | None:
    """E_bf16: the bf16 reference's largest |Δp| against the fp32 reference over the requests `ids`,
    probabilities at `temperature` (from the references alone; None when either dtype did not
    run). `refs`: {dtype: ReferenceRun}."""
    if "bf16" not in refs or "fp32" not in refs:
        return None
    worst = None
    for rid in ids:
        lo, hi = refs["bf16"].by_id[rid], refs["fp32"].by_id[rid]
        if not (lo["ok"] and hi["ok"]):
            continue
        for a, b in zip(lo["logits"], hi["logits"]):
            e = max(abs_errors(probabilities(a, temperature), probabilities(b, temperature)))
            worst = e if worst is None else max(worst, e)
    return worst


def gate_bounds(gate: Gate, bf16_err: float | None) -> dict:
    """What each rule compares against. `bf16_err`: E_bf16 (None if no bf16 reference ran)."""
    if gate.kind == "exact":
        bound = gate["max_abs_dp"]
        return {"kind": "exact", "per_option": bound, "decision_margin": gate["decision_margin_factor"] * bound,
                "judged": "runtime vs reference", "decisions_against": "reference"}
    if bf16_err is None:
        raise ValueError(f"the {gate.kind} gate needs the bf16 reference's error (E_bf16) on the same requests")
    if gate.kind == "fp32-rounding":
        bound = fp32_rounding_bound(gate, bf16_err)
        return {"kind": gate.kind, "per_option": bound, "decision_margin": gate["decision_margin_factor"] * bound,
                "bf16_error": bf16_err, "judged": "runtime vs reference", "decisions_against": "reference"}
    yardstick = math.sqrt(gate.roundings) * bf16_err
    return {"kind": gate.kind, "per_option": gate["a"] * yardstick + gate["b"],
            "decision_margin": max(gate["margin_floor"], gate["margin_factor"] * yardstick),
            "bf16_error": bf16_err, "roundings": gate.roundings, "yardstick": yardstick,
            "judged": "runtime vs fp32 truth", "decisions_against": "fp32"}


def judge(gate: Gate, entries: list[dict], bounds: dict, requested: str) -> dict:
    """Apply the per-option and decision rules to every measured question (sets their verdicts)
    and the distribution rules to the set; returns the distribution results."""
    against = requested if bounds["decisions_against"] == "reference" else "fp32"
    for e in entries:
        for q in e["questions"]:
            if "runtime" not in q.get("p", {}):
                continue
            judged = abs_errors(q["p"]["runtime"], q["p"][against])
            q["judged_error"] = max(judged)
            margin = q["margin"][against]
            q["decision_gated"] = gated(margin, bounds["decision_margin"])
            q["decision_agree"] = q["decision"]["runtime"] == q["decision"][against]
            problems = []
            worst = max(range(len(judged)), key=lambda i: judged[i])
            if not within(judged[worst], bounds["per_option"]):
                problems.append(f"|Δp| {judged[worst]:.3g} ({q['keys'][worst]}, {bounds['judged']}) > {bounds['per_option']:.3g}")
            if q["decision_gated"] and not q["decision_agree"]:
                problems.append(f"decision {q['decision']['runtime']!r} != {against} {q['decision'][against]!r} at margin {margin:.3g} >= {bounds['decision_margin']:.3g}")
            q["problems"] = problems
            q["verdict"] = "pass" if not problems else "fail"
    for e in entries:
        if "verdict" in e and not e["questions"]:
            continue  # decided before the numbers (rejected by one or both sides)
        bad = [q for q in e["questions"] if q.get("verdict") != "pass"]
        e["verdict"] = "pass" if not e["problems"] and not bad else "fail"
    return distribution(gate, entries) if gate.kind == "truth-relative" else {"applied": False, "why": f"{gate.kind} gate: per option only"}


def distribution(gate: Gate, entries: list[dict]) -> dict:
    """Mean and p95 over questions of the runtime's largest |Δp| against the fp32 truth, each
    against sqrt(roundings) x the bf16 reference's own, when the set has enough questions
    (one-candidate questions, always exact, are left out)."""
    qs = [q for q in measured_questions(entries) if len(q["keys"]) > 1 and "bf16" in q["p"] and "fp32" in q["p"]]
    n = len(qs)
    out = {"applied": n >= gate["min_questions"], "questions": n, "min_questions": gate["min_questions"], "problems": []}
    if not qs:
        return out
    runtime = [max(abs_errors(q["p"]["runtime"], q["p"]["fp32"])) for q in qs]
    scale = math.sqrt(gate.roundings)
    reference = [scale * max(abs_errors(q["p"]["bf16"], q["p"]["fp32"])) for q in qs]
    add = gate["distribution_additive"]
    for stat, fn, spread in (("mean", mean, 1.0), ("p95", p95, gate["p95_spread"])):
        f = distribution_factor(gate, n, spread)
        rt_value, ref_value = fn(runtime), fn(reference)
        bound = f * ref_value + add
        ok = within(rt_value, bound)
        out[stat] = {"runtime": rt_value, "reference": ref_value, "factor": f, "bound": bound, "ok": ok}
        if out["applied"] and not ok:
            out["problems"].append(f"{stat} of the runtime's |Δp| vs fp32 {rt_value:.3g} > {f:.3g} x {ref_value:.3g} (the bf16 reference's, x sqrt({gate.roundings})) + {add:g} = {bound:.3g}")
    if out["applied"]:
        out["ok"] = not out["problems"]
    else:
        out["why"] = f"{n} questions < {gate['min_questions']}: the statistics are reported, not gated"
    # For the record, not a rule: options where the runtime's error exceeds a x the reference's own
    # error on that same option + b (two independent roundings of one size exceed 2x each other
    # about 30% of the time, which is why the rule scales with the set's E_bf16 instead).
    pairs = [(r, s_) for q in qs for r, s_ in zip(abs_errors(q["p"]["runtime"], q["p"]["fp32"]), abs_errors(q["p"]["bf16"], q["p"]["fp32"]))]
    out["paired"] = {"options": len(pairs), "over": sum(1 for r, s_ in pairs if r > gate["a"] * scale * s_ + gate["b"])}
    return out
