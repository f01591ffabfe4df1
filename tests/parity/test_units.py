"""Pieces of the harness that need no model: Valen's answer formulas, every comparison of the gate
at its boundary, the import blocker, the Valen-source refusals, the prompt constants, the built-in
cases."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import textwrap

import pytest

from parity import answers, cases, compare, isolation, prompt, valen_source
from parity.reference_run import REPO_ROOT
from parity.tolerances import load as load_tolerances


# ---------------------------------------------------------------- answer formulas (docs/valen-model.md)


def test_score_worked_example():
    n = answers.answer_numbers("score", [0.1, 0.3, 0.6])
    assert n["mode"] == 2
    assert n["score"] == pytest.approx(1.5)
    assert n["confidence"] == pytest.approx(0.25)


def test_choice_confidence_examples():
    assert answers.answer_numbers("choice", [0.4459854086288687, 0.5540145913711313])["confidence"] == pytest.approx(0.10802918274226259, abs=1e-15)
    assert answers.answer_numbers("choice", [1 / 3] * 3)["confidence"] == pytest.approx(0.0, abs=1e-15)
    assert answers.answer_numbers("choice", [1.0])["confidence"] == 1.0
    assert answers.answer_numbers("noul", [0.7, 0.3]) == {"mode": 0, "confidence": None, "score": None}


def test_probabilities_fp32_softmax_float64_renormalised():
    p = answers.probabilities([0.0, 0.0, 0.0])
    assert p == [1 / 3, 1 / 3, 1 / 3] or abs(sum(p) - 1) < 1e-15
    assert answers.first_max([0.25, 0.5, 0.5]) == 1  # ties -> earliest
    assert answers.top_two_margin([0.2, 0.5, 0.3]) == pytest.approx(0.2)
    assert answers.top_two_margin([1.0]) is None


# ---------------------------------------------------------------- the gate's comparisons at their boundaries

NEXT_UP = math.nextafter


def test_within_passes_the_bound_itself_and_fails_just_above():
    for bound in (0.0, 1e-6, 0.0437, 0.25):
        assert compare.within(bound, bound)
        assert not compare.within(NEXT_UP(bound, math.inf), bound)
        assert compare.within(NEXT_UP(bound, -math.inf), bound) or bound == 0.0


def test_decisions_are_gated_from_the_threshold_on():
    assert compare.gated(0.05, 0.05)
    assert not compare.gated(NEXT_UP(0.05, 0.0), 0.05)
    assert compare.gated(None, 0.05)  # one candidate: nothing to flip, always checked


def test_p95_is_the_nearest_rank():
    values = [float(i) for i in range(1, 21)]  # ceil(0.95 * 20) = 19th smallest
    assert compare.p95(values) == 19.0
    assert compare.p95(list(reversed(values))) == 19.0
    assert compare.p95([3.0]) == 3.0
    assert compare.p95([float(i) for i in range(1, 101)]) == 95.0


def _gate(lora="separate", dtype="bf16", mode="shared-prefix"):
    return next(g for g in load_tolerances() if g.key == (lora, dtype, "cpu", mode))


def test_bounds_follow_the_declared_formulas():
    exact = compare.gate_bounds(_gate(mode="per-branch"), None)
    assert exact["per_option"] == 1e-6 and exact["decision_margin"] == 2e-6 and exact["decisions_against"] == "reference"
    fp32 = _gate(dtype="fp32")
    b = compare.gate_bounds(fp32, 0.05)
    assert b["per_option"] == fp32["factor"] * 2.0**-16 * 0.05
    assert b["decision_margin"] == fp32["decision_margin_factor"] * b["per_option"]
    assert compare.gate_bounds(fp32, 0.0)["per_option"] == fp32["floor"]  # never below the floor
    tr = _gate()
    b = compare.gate_bounds(tr, 0.05)
    assert b["per_option"] == tr["a"] * 0.05 + tr["b"] and b["decisions_against"] == "fp32"
    assert b["decision_margin"] == max(tr["margin_floor"], tr["margin_factor"] * 0.05)
    assert compare.gate_bounds(tr, 0.001)["decision_margin"] == tr["margin_floor"]
    merged = _gate("merged", "bf16")
    assert merged.roundings == 2
    assert compare.gate_bounds(merged, 0.05)["per_option"] == merged["a"] * math.sqrt(2) * 0.05 + merged["b"]
    with pytest.raises(ValueError, match="E_bf16"):
        compare.gate_bounds(tr, None)
    assert compare.distribution_factor(tr, 200) == 1 + tr["z"] * math.sqrt(2 / 200)
    assert compare.distribution_factor(tr, 200, tr["p95_spread"]) == 1 + tr["z"] * tr["p95_spread"] * math.sqrt(2 / 200)


def _question(p_runtime, p_against, keys=None, against="bf16"):
    keys = keys or [str(i) for i in range(len(p_runtime))]
    p = {"runtime": p_runtime, against: p_against, "fp32": p_against, "bf16": p_against}
    margin = answers.top_two_margin(p_against)
    decision = {side: keys[answers.first_max(v)] for side, v in p.items()}
    return {"qid": "q", "kind": "choice", "keys": keys, "p": p, "margin": {"bf16": margin, "fp32": margin}, "decision": decision}


def _judge(question, per_option, margin, kind="exact"):
    entries = [{"case": "c", "name": "n", "checks": {}, "problems": [], "questions": [question]}]
    gate = _gate(mode="per-branch") if kind == "exact" else _gate()
    bounds = {"per_option": per_option, "decision_margin": margin, "judged": "runtime vs reference",
              "decisions_against": "reference" if kind == "exact" else "fp32"}
    compare.judge(gate, entries, bounds, "bf16")
    return entries[0]


def test_per_option_rule_at_its_bound():
    # |Δp| = 0.25 exactly (binary fractions): at the bound passes, one ulp below the bound fails.
    assert _judge(_question([0.75, 0.25], [0.5, 0.5]), 0.25, 1.0)["verdict"] == "pass"
    failed = _judge(_question([0.75, 0.25], [0.5, 0.5]), NEXT_UP(0.25, 0.0), 1.0)
    assert failed["verdict"] == "fail" and "|Δp| 0.25" in failed["questions"][0]["problems"][0]


def test_decision_rule_at_its_margin():
    # The reference prefers "0" by a margin of 0.25; the runtime prefers "1"; |Δp| within bound.
    q = lambda: _question([0.375, 0.625], [0.625, 0.375])  # noqa: E731
    assert _judge(q(), 1.0, 0.25)["verdict"] == "fail"  # margin 0.25 >= 0.25: gated, disagrees
    assert _judge(q(), 1.0, NEXT_UP(0.25, 1.0))["verdict"] == "pass"  # below the threshold: not gated
    assert _judge(_question([0.375, 0.625], [0.625, 0.375]), 1.0, 0.25, kind="truth-relative")["verdict"] == "fail"


def test_distribution_rule_at_its_bound(monkeypatch):
    import dataclasses

    gate = _gate()
    n = int(gate["min_questions"])
    # Factor 1, no additive term: the bound is the reference's statistic itself, exactly.
    monkeypatch.setattr(compare, "distribution_factor", lambda g, questions, spread=1.0: 1.0)
    gate = dataclasses.replace(gate, params=dict(gate.params, distribution_additive=0.0))

    def entries(runtime_p0):
        qs = [_question([runtime_p0, 1 - runtime_p0], [0.5, 0.5]) for _ in range(n)]
        for q in qs:
            q["p"]["bf16"] = [0.75, 0.25]  # the reference's error: 0.25 on every question
        return [{"case": "c", "name": str(i), "checks": {}, "problems": [], "questions": [q]} for i, q in enumerate(qs)]

    at = compare.distribution(gate, entries(0.75))
    assert at["applied"] and at["ok"] and at["mean"]["runtime"] == at["mean"]["bound"] == 0.25 == at["p95"]["bound"]
    above = compare.distribution(gate, entries(NEXT_UP(0.75, 1.0)))
    assert not above["ok"] and len(above["problems"]) == 2  # mean and p95
    few = compare.distribution(gate, entries(NEXT_UP(0.75, 1.0))[: n - 1])
    assert not few["applied"] and "ok" not in few and not few["problems"]  # reported, not gated
    assert few["mean"]["ok"] is False and "not gated" in few["why"]


def test_tensor_and_rotary_checks_at_their_bound():
    import torch

    a = torch.tensor([0.0, 1.0])
    assert compare.compare_tensor("x", a, a + torch.tensor([0.0, 0.25]), 0.25)["ok"]
    assert not compare.compare_tensor("x", a, a + torch.tensor([0.0, 0.25]), NEXT_UP(0.25, 0.0))["ok"]
    assert not compare.compare_tensor("x", a, a[:1], 1.0)["ok"]  # shapes differ
    pos = torch.zeros(3, 2, dtype=torch.int64)
    tables = torch.zeros(2, 2, 4)
    assert compare.compare_rotary({"positions": pos, "tables": tables}, {"positions": pos, "tables": tables}, 0.0)["ok"]
    moved = tables.clone()
    moved[1, 1, 3] = 2.0**-30
    assert not compare.compare_rotary({"positions": pos, "tables": tables}, {"positions": pos, "tables": moved}, 0.0)["ok"]
    other = pos.clone()
    other[1, 1] = 1
    assert "position ids differ" in compare.compare_rotary({"positions": pos, "tables": tables}, {"positions": other, "tables": tables}, 1.0)["problems"][0]


def test_answer_formula_at_its_bound():
    keys, p = ["a", "b"], [0.75, 0.25]
    nums = answers.answer_numbers("choice", p)
    exact = {"type": "choice", "probabilities": {"a": 0.75, "b": 0.25}, "choice": "a", "confidence": nums["confidence"]}
    assert compare._answer_formula_delta("choice", keys, ["A", "B"], p, nums, exact) == (0.0, [])
    off = dict(exact, probabilities={"a": 0.75 + 2.0**-10, "b": 0.25})
    delta, problems = compare._answer_formula_delta("choice", keys, ["A", "B"], p, nums, off)
    assert delta == 2.0**-10 and not problems
    swapped = dict(exact, probabilities={"b": 0.25, "a": 0.75})
    assert compare._answer_formula_delta("choice", keys, ["A", "B"], p, nums, swapped)[0] == math.inf


# ---------------------------------------------------------------- prompt constants and cases


def test_noul_candidates_byte_for_byte():
    (tk, td), (fk, fd) = prompt.NOUL_CANDIDATES
    assert (tk, fk) == ("true", "false")
    assert hashlib.sha256(td.encode()).hexdigest() == "6013d06fe04f22ce6913bd38a63e0b8f0a8e5f4b67b9bbe788633b5ebdad32dc"
    assert hashlib.sha256(fd.encode()).hexdigest() == "8682831f01e2c5676edeff84b87f29faee29b26872a9fc034082cdb9b8c9912c"


def test_builtin_cases_cover_the_brief():
    all_cases = cases.cases("all")
    kinds = {q["type"] for _, _, r in all_cases for q in r["questions"].values()}
    assert kinds == {"choice", "noul", "score"}
    assert any(isinstance(r["state"], dict) and "image" in r["state"] for _, _, r in all_cases)
    assert any(isinstance(r["state"], str) for _, _, r in all_cases)
    assert any(len(r["questions"]) >= 3 for _, _, r in all_cases)
    text = repr([r for _, _, r in all_cases])
    for needle in ("白色", "\\u0301", "👍🏽", "नमस्ते"):
        assert needle in text or needle.encode().decode("unicode_escape") in text
    assert cases.cases("all") == all_cases  # deterministic bytes, images included
    assert any(isinstance(r["state"], dict) and "video" in r["state"] for _, _, r in all_cases)
    with pytest.raises(KeyError):
        cases.cases("audio")


def test_wire_state_to_record(tmp_path):
    url = cases.images()["small_png"]
    rec = prompt.wire_to_state({"image": url}, tmp_path)
    item = rec["messages"][0]["content"][0]
    assert item["type"] == "image_url" and item["image_url"]["url"].endswith("input.png")
    assert (tmp_path / "input.png").read_bytes()[:4] == b"\x89PNG"
    assert prompt.wire_to_state({"a": "é"}, tmp_path) == '{"a": "é"}'
    assert prompt.wire_candidates({"type": "choice", "criteria": {"k": None}}) == [("k", "k")]
    assert prompt.wire_candidates({"type": "score", "criteria": ["a", "b"]}) == [("0", "a"), ("1", "b")]


# ---------------------------------------------------------------- import isolation


def test_blocker_hides_installed_kernel_packages(tmp_path):
    for name in isolation.BLOCKED:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    code = textwrap.dedent(
        """
        import importlib.util, sys
        names = %r
        assert all(importlib.util.find_spec(n) is not None for n in names), "fake packages not visible"
        for n in names:
            sys.modules.pop(n, None)
        from parity.isolation import install_blocker
        install_blocker()
        assert all(importlib.util.find_spec(n) is None for n in names)
        for n in names:
            try:
                __import__(n + ".sub")
            except ModuleNotFoundError:
                pass
            else:
                raise SystemExit(n + " importable")
        print("blocked")
        """
        % (isolation.BLOCKED,)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "blocked" in out.stdout


def test_blocker_refuses_when_already_imported():
    code = "import sys, types; sys.modules['fla'] = types.ModuleType('fla'); from parity.isolation import install_blocker; install_blocker()"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True)
    assert out.returncode != 0 and "imported before the parity blocker" in out.stderr


def test_clean_environment_drops_kernel_paths():
    env = isolation.clean_environment({"PYTHONPATH": os.pathsep.join(["/src/flash-linear-attention", "/x/causal-conv1d/build", "/keep/me"]), "PATH": "/bin"})
    assert env["PYTHONPATH"] == "/keep/me"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "PYTHONPATH" not in isolation.clean_environment({"PYTHONPATH": "/opt/fla"})


# ---------------------------------------------------------------- --valen-source refusals


def _git(cwd, *args):
    subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"))


def test_valen_source_refusals(tmp_path):
    with pytest.raises(valen_source.ValenSourceError, match="must be a directory"):
        valen_source.check_checkout(tmp_path / "missing")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(valen_source.ValenSourceError, match="not a git checkout"):
        valen_source.check_checkout(plain)
    repo = tmp_path / "Valen"
    (repo / "valen").mkdir(parents=True)
    (repo / "valen" / "__init__.py").write_text("MODEL_NAME = 'Valen'\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "not the pinned commit")
    with pytest.raises(valen_source.ValenSourceError) as e:
        valen_source.check_checkout(repo)
    assert "not the pinned Valen commit 750bfcfbb48a5275534a9c912257ebe83ca57a97" in str(e.value)
    with pytest.raises(valen_source.ValenSourceError, match="not the pinned"):
        valen_source.ValenSource(repo)


# ---------------------------------------------------------------- one prompt record for both reference sources


def test_valen_source_prompt_record_equals_the_rebuilt_one():
    # Valen's own compiler keeps whole branch inputs (state + suffix); the rebuilt compiler keeps
    # the state once and suffix ids. The same prompt must give the same record either way.
    from types import SimpleNamespace

    import torch

    im_start = 7
    state = [1, 2, 3, 4]
    suffixes = [[im_start, 10, 11], [im_start, 12]]
    media = [{"kind": "image", "sha256": "ab"}]
    base = {"input_ids": torch.tensor([state]), "mm_token_type_ids": torch.tensor([[0, 1, 1, 0]]),
            "image_grid_thw": torch.tensor([[1, 2, 4]])}
    ref = prompt.RefPrompt(
        base=base,
        questions=[prompt.RefQuestion("q", "choice", ["a", "b"], ["A", "B"],
                                      [prompt.RefBranch(s, [len(state) + 1], len(state) + len(s) - 1) for s in suffixes])],
        logical_tokens=len(state) + 5, compute_tokens=2 * len(state) + 5, media=media,
    )
    branches = [
        SimpleNamespace(inputs={"input_ids": torch.tensor([state + s]), "mm_token_type_ids": torch.tensor([[0, 1, 1, 0] + [0] * len(s)]),
                                "image_grid_thw": torch.tensor([[1, 2, 4]])},
                        candidate_positions=(len(state) + 1,), decision_position=len(state) + len(s) - 1)
        for s in suffixes
    ]
    compiled = SimpleNamespace(
        questions=[SimpleNamespace(qid="q", kind="choice", keys=("a", "b"), descriptions=("A", "B"), branches=branches)],
        logical_tokens=len(state) + 5, compute_tokens=2 * len(state) + 5,
        media=[dict(media[0], sampling={"fps": 2})],  # Valen's sampling note is not part of the record
    )
    assert valen_source._Prompt(compiled, im_start).to_json() == ref.to_json()


# ---------------------------------------------------------------- the gate's plan (no model)


def test_gate_plans_each_runtime_run_once_per_device():
    from parity.cli import needed_runs
    from parity.gate import GATE_TEMPERATURE, configurations
    from parity.runtime_adapter import EngineOptions, module_path_options

    gates = load_tolerances()

    def gate_of(c):
        return next(g for g in gates if g.key == (c.lora, c.options.dtype, c.options.device, c.options.mode))

    cuda = configurations("cuda")
    assert [(c.lora, c.options) for c in cuda] == [
        ("separate", EngineOptions("cuda", "bf16", "shared-prefix")),
        ("merged", EngineOptions("cuda", "bf16", "shared-prefix")),
        ("merged", module_path_options(EngineOptions("cuda"))),
    ]
    runs = {(c.lora, o) for c in cuda for o in needed_runs(gate_of(c), c.options).values()}
    # separate: the default in bf16 and fp32; merged: the same plus the module-path anchor (judged too)
    assert runs == {("separate", EngineOptions("cuda", "bf16", "shared-prefix")), ("separate", EngineOptions("cuda", "fp32", "shared-prefix")),
                    ("merged", EngineOptions("cuda", "bf16", "shared-prefix")), ("merged", EngineOptions("cuda", "fp32", "shared-prefix")),
                    ("merged", EngineOptions("cuda", "fp32", "shared-prefix", kernels="torch", graphs=False))}
    cpu = configurations("cpu")
    assert len(cpu) == 13 and len({(c.lora, c.options) for c in cpu}) == 13
    assert [c.options.temperature for c in cpu].count(1.0) == 12  # one configuration at GATE_TEMPERATURE
    # On the CPU every dual run and anchor is one of the configurations' own runs, but the fp32 dual
    # run of the configuration at another temperature.
    own = {(c.lora, c.options) for c in cpu}
    dual_at_t = ("separate", EngineOptions("cpu", "fp32", "shared-prefix", kernels="fast", temperature=GATE_TEMPERATURE))
    assert {(c.lora, o) for c in cpu for o in needed_runs(gate_of(c), c.options).values()} == own | {dual_at_t}


def test_with_dtype_resolves_the_dtype_dependent_choices_afresh(monkeypatch, tmp_path):
    """The fp32 dual run of a bf16 CUDA configuration: FLA and the one-pass layout are bf16's
    choices (FLA runs fp32 in TF32), so fp32 gets the reference rule and the batch layout, as
    options made for fp32 directly would; calibrated options stay replaceable."""
    import dataclasses
    import json

    from parity.runtime_adapter import module_path_options, runtime_options, with_dtype
    from valen_runtime import options as options_module
    from valen_runtime.options import EngineOptions

    monkeypatch.setattr(options_module, "_fla_available", lambda: True)
    bf16 = runtime_options("cuda", "bf16", "shared-prefix", kernels="fast")
    assert (bf16.delta_kernel, bf16.layout, bf16.graphs, bf16.compile) == ("fla", "one-pass", True, True)
    fp32 = with_dtype(bf16, "fp32")
    assert fp32 == EngineOptions(device="cuda", dtype="fp32", mode="shared-prefix", kernels="fast")
    assert (fp32.delta_kernel, fp32.layout) == ("torch", "batch")
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"temperature": 0.8}))
    calibrated = EngineOptions(device="cpu", calibration=str(calibration))
    assert calibrated.temperature == 0.8 and dataclasses.replace(calibrated, dtype="fp32").temperature == 0.8
    assert with_dtype(calibrated, "fp32").temperature == module_path_options(calibrated).temperature == 0.8
