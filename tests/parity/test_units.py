"""Pieces of the harness that need no model: §10 formulas, the import blocker, the Valen-source
refusals, the prompt constants, the built-in cases."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from parity import cases, harness, isolation, prompt, valen_source


# ---------------------------------------------------------------- §10 formulas (docs/valen-model.md)


def test_score_worked_example():
    n = harness.answer_numbers("score", [0.1, 0.3, 0.6])
    assert n["mode"] == 2
    assert n["score"] == pytest.approx(1.5)
    assert n["confidence"] == pytest.approx(0.25)


def test_choice_confidence_examples():
    assert harness.answer_numbers("choice", [0.4459854086288687, 0.5540145913711313])["confidence"] == pytest.approx(0.10802918274226259, abs=1e-15)
    assert harness.answer_numbers("choice", [1 / 3] * 3)["confidence"] == pytest.approx(0.0, abs=1e-15)
    assert harness.answer_numbers("choice", [1.0])["confidence"] == 1.0
    assert harness.answer_numbers("noul", [0.7, 0.3]) == {"mode": 0, "confidence": None, "score": None}


def test_probabilities_fp32_softmax_float64_renormalised():
    p = harness.probabilities([0.0, 0.0, 0.0])
    assert p == [1 / 3, 1 / 3, 1 / 3] or abs(sum(p) - 1) < 1e-15
    assert harness.first_max([0.25, 0.5, 0.5]) == 1  # ties -> earliest
    assert harness.top_two_margin([0.2, 0.5, 0.3]) == pytest.approx(0.2)
    assert harness.top_two_margin([1.0]) is None


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
    with pytest.raises(KeyError):
        cases.cases("video")


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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(harness.REPO_ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "blocked" in out.stdout


def test_blocker_refuses_when_already_imported():
    code = "import sys, types; sys.modules['fla'] = types.ModuleType('fla'); from parity.isolation import install_blocker; install_blocker()"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT)), capture_output=True, text=True)
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
