"""Fuzzing the exporter's checkpoint reader: whatever `checkpoint.pt` holds, reading it ends in a
clean ExportError (one line) or a valid checkpoint, never in another exception.

The reader is what `export()` runs before writing anything: `open_checkpoint` (pinned SHA-256,
weights_only unpickling, training config), `open_base` (the payload's base_manifest against the
base) and `check_trainable_set` (names, shapes, dtypes, finiteness). The pin is updated to each
mutated file's hash, so the mutation itself is what is exercised, not the hash check.

Crashes the fuzzer found in the reader (valen_export/sources.py), now fixed and kept as
regression cases in `test_former_reader_crashes_are_clean_refusals`:
  - a non-string key in payload["weights"] (TypeError in check_trainable_set's sorted/join),
  - a truthy non-dict payload["base_manifest"] (AttributeError: .get in open_base),
  - a tensor as a payload["config"] value (RuntimeError: ambiguous truth value in check_training_config),
  - a weight name containing a newline (the ExportError message spans two lines),
  - a corrupt pickle inside the archive that makes torch's weights_only unpickler raise KeyError,
    IndexError, TypeError or AttributeError (open_checkpoint converts only RuntimeError, EOFError,
    BadZipFile, ValueError, OSError and UnpicklingError); the byte-flip fuzzer hit these in about
    1-2% of examples.
"""

from __future__ import annotations

import copy
import io
import json
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from valen_export.errors import ExportError
from valen_export.sources import check_trainable_set, open_base, open_checkpoint
from valen_runtime.safetensors_file import sha256_file

SETTINGS = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class _Source(dict):
    def __repr__(self):  # keep hypothesis' failure reports short
        return "<tiny fixture checkpoint>"


@pytest.fixture(scope="module")
def source(tiny_fixture):
    path = tiny_fixture.checkpoint / "checkpoint.pt"
    return _Source({
        "fixture": tiny_fixture,
        "bytes": path.read_bytes(),
        "payload": torch.load(path, weights_only=True),
        "config": (tiny_fixture.checkpoint / "config.json").read_text(),
        "pins": json.loads(tiny_fixture.pins.read_text()),
    })


def read_checkpoint(source, write) -> str:
    """Write a checkpoint folder with write(path), pin its hash, run the reader; 'ok' or the ExportError line."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        (folder / "config.json").write_text(source["config"])
        write(folder / "checkpoint.pt")
        pins = copy.deepcopy(source["pins"])
        pins["checkpoint"]["checkpoint_sha256"] = sha256_file(folder / "checkpoint.pt")
        try:
            ck = open_checkpoint(folder, pins)
            base = open_base(source["fixture"].base, pins, ck)
            check_trainable_set(ck, base, pins)
        except ExportError as e:
            msg = str(e)
            assert msg.strip(), "an ExportError must say what is wrong"
            return msg
        # Anything else propagates and fails the test with its traceback.
        return "ok"


# -- byte-level: flips and truncations --------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_byte_flips_and_truncations(source, data):
    raw = bytearray(source["bytes"])
    n = len(raw)
    flips = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, 255)), min_size=0, max_size=8), label="flips")
    for pos, x in flips:
        raw[pos] ^= x
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, n - 1), label="length")]
    outcome = read_checkpoint(source, lambda p: p.write_bytes(bytes(raw)))
    if not flips and len(raw) < n:
        assert outcome != "ok"  # a truncated archive is never accepted


# -- structural: mutations of the payload dict --------------------------------------------------

WRONG = [None, 0, 1.5, "x", b"x", [], [1, 2], {}, {"a": 1}, (1,), True, torch.zeros(2)]
WRONG_VALUES = st.sampled_from(WRONG)
NON_TENSOR_VALUES = WRONG_VALUES
FALSY_OR_DICT_VALUES = st.sampled_from([None, 0, "", [], {}, {"a": 1}, {"revision": 1}, 1.5, "x", [1], torch.zeros(2)])
DTYPES = st.sampled_from([torch.float16, torch.float64, torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.bool, torch.uint8])
TOP_KEYS = ["weights", "config", "base_manifest", "optimizer", "progress", "rng", "distributed"]


def mutation_strategy(payload):
    names = sorted(payload["weights"])
    name = st.sampled_from(names)
    return st.one_of(
        # (description, must the reader refuse it?, function payload -> None)
        st.tuples(st.just("drop top key"), st.sampled_from(TOP_KEYS)).map(lambda a: (a, a[1] in ("weights", "base_manifest"), lambda p: p.pop(a[1], None))),
        st.tuples(st.just("wrong type top key"), st.sampled_from([k for k in TOP_KEYS if k != "base_manifest"]), WRONG_VALUES).map(
            lambda a: (a, a[1] == "weights", lambda p: p.__setitem__(a[1], a[2]))
        ),
        st.tuples(st.just("wrong type base_manifest"), FALSY_OR_DICT_VALUES).map(lambda a: (a, True, lambda p: p.__setitem__("base_manifest", a[1]))),
        st.tuples(st.just("extra top key"), st.text(max_size=8), WRONG_VALUES).map(lambda a: (a, False, lambda p: p.__setitem__("x-" + a[1], a[2]))),
        st.tuples(st.just("drop weight"), name).map(lambda a: (a, True, lambda p: p["weights"].pop(a[1]))),
        st.tuples(st.just("extra weight"), st.sampled_from(["backbone.extra.weight", "head.bias", "", "backbone.visual.blocks.0.norm1.weight"])).map(
            lambda a: (a, True, lambda p: p["weights"].__setitem__(a[1], torch.zeros(4)))
        ),
        st.tuples(st.just("weight wrong type"), name, WRONG_VALUES).map(lambda a: (a, True, lambda p: p["weights"].__setitem__(a[1], a[2]))),
        st.tuples(st.just("weight wrong shape"), name, st.sampled_from(["t", "slice", "flat", "unsqueeze", "empty"])).map(
            lambda a: (a, True, lambda p: p["weights"].__setitem__(a[1], _reshape(p["weights"][a[1]], a[2])))
        ),
        st.tuples(st.just("weight wrong dtype"), name, DTYPES).map(
            lambda a: (a, a[2] != p_dtype(payload, a[1]), lambda p: p["weights"].__setitem__(a[1], p["weights"][a[1]].to(a[2])))
        ),
        st.tuples(st.just("weight non-finite"), name, st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.integers(0, 10**6)).map(
            lambda a: (a, True, lambda p: _poison(p["weights"][a[1]], a[2], a[3]))
        ),
        st.tuples(st.just("config field"), st.sampled_from(["stage", "lora_rank", "lora_alpha", "projection_dim", "max_length"]), NON_TENSOR_VALUES).map(
            lambda a: (a, True, lambda p: p["config"].__setitem__(a[1], a[2]))
        ),
        st.tuples(st.just("base_manifest field"), st.sampled_from(["revision", "weight_sha256", "repo"]), WRONG_VALUES).map(
            lambda a: (a, a[1] != "repo", lambda p: p["base_manifest"].__setitem__(a[1], a[2]))
        ),
        st.tuples(st.just("base_manifest weight hash"), st.sampled_from(["drop", "rename", "badhash", "extra"])).map(
            lambda a: (a, True, lambda p: _hashes(p["base_manifest"]["weight_sha256"], a[1]))
        ),
    )


def p_dtype(payload, name):
    return payload["weights"][name].dtype


def _reshape(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "t":
        return t.t().contiguous() if t.ndim == 2 and t.shape[0] != t.shape[1] else t.reshape(-1)[:-1].clone()
    if how == "slice":
        return t[:-1].clone()
    if how == "flat":
        return t.reshape(-1).clone() if t.ndim > 1 else t.reshape(1, -1).clone()
    if how == "unsqueeze":
        return t.unsqueeze(0).clone()
    return torch.empty(0, dtype=t.dtype)


def _poison(t: torch.Tensor, value: float, index: int) -> None:
    t.view(-1)[index % t.numel()] = value


def _hashes(h: dict, how: str) -> None:
    name = sorted(h)[0]
    if how == "drop":
        h.pop(name)
    elif how == "rename":
        h["renamed.safetensors"] = h.pop(name)
    elif how == "badhash":
        h[name] = "0" * 64
    else:
        h["model-extra.safetensors"] = "1" * 64


# The reader's contract, stated independently of how a payload was mutated: these are the parts
# of checkpoint.pt it must check against the original. Judging the final payload (not the list of
# mutations) keeps compositions honest: a second transpose or reshape that restores the original
# shape, or a dtype cast back, leaves nothing to refuse.
CHECKED_BASE_MANIFEST_FIELDS = ("revision", "weight_sha256")


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # the original payload holds no tensors outside "weights"
    return type(a) is type(b) and a == b


def must_refuse(original: dict, final: dict) -> str | None:
    """Why the reader must refuse `final` (the first reason found), or None when it must accept it."""
    weights, want = final.get("weights"), original["weights"]
    if not isinstance(weights, dict):
        return "weights is not a dict"
    if set(weights) != set(want):
        return "weight names differ"
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.shape != want[name].shape or t.dtype != want[name].dtype:
            return f"{name} has another shape or dtype"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name} is not finite"
    manifest = final.get("base_manifest")
    if not isinstance(manifest, dict):
        return "base_manifest is not a dict"
    for field in CHECKED_BASE_MANIFEST_FIELDS:
        if field not in manifest or not _same_value(manifest[field], original["base_manifest"][field]):
            return f"base_manifest.{field} differs"
    config = final.get("config")  # optional: a cross-check of config.json for the fields it holds
    if isinstance(config, dict):
        for field, value in config.items():
            if field in original["config"] and not _same_value(value, original["config"][field]):
                return f"config.{field} differs"
    return None


@SETTINGS
@given(data=st.data())
def test_structural_payload_mutations(source, data):
    payload = copy.deepcopy(source["payload"])
    mutations = data.draw(st.lists(mutation_strategy(payload), min_size=1, max_size=3), label="mutations")
    for _desc, _fails, apply in mutations:
        try:
            apply(payload)
        except (KeyError, TypeError, AttributeError, IndexError, RuntimeError):
            continue  # an earlier mutation removed what this one changes
    reason = must_refuse(source["payload"], payload)
    outcome = read_checkpoint(source, lambda p: torch.save(payload, p))
    if reason is not None:
        assert outcome != "ok", (reason, [m[0] for m in mutations])
    # Each single mutation's own label says whether it alone must be refused; the oracle must agree
    # with it, so the oracle cannot drift into accepting what the reader is meant to refuse.
    if len(mutations) == 1:
        assert (reason is not None) == mutations[0][1], (reason, mutations[0][0])


def test_double_transpose_and_double_flatten_restore_the_payload(source):
    """The compositions that used to be expected as refusals: the final payload equals the original."""
    payload = copy.deepcopy(source["payload"])
    name = next(n for n, t in sorted(payload["weights"].items()) if t.ndim == 2 and t.shape[0] != t.shape[1])
    for how in ("t", "t"):
        payload["weights"][name] = _reshape(payload["weights"][name], how)
    assert must_refuse(source["payload"], payload) is None
    assert read_checkpoint(source, lambda p: torch.save(payload, p)) == "ok"
    payload["weights"][name] = _reshape(payload["weights"][name], "t")
    assert must_refuse(source["payload"], payload) is not None
    assert read_checkpoint(source, lambda p: torch.save(payload, p)) != "ok"


def test_unmutated_payload_reads(source):
    assert read_checkpoint(source, lambda p: torch.save(source["payload"], p)) == "ok"


def crafted_pickle(pkl: bytes):
    """A torch.save archive whose data.pkl is replaced by `pkl` (a corrupt pickle)."""

    def write(path):
        buf = io.BytesIO()
        torch.save({"weights": {}}, buf)
        src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
        with zipfile.ZipFile(path, "w") as z:
            for name in src.namelist():
                z.writestr(name, pkl if name.endswith("data.pkl") else src.read(name))

    return write


def saved(mutate):
    def write_for(source):
        payload = copy.deepcopy(source["payload"])
        mutate(payload)
        return lambda path: torch.save(payload, path)

    return write_for


KNOWN_CRASHES = {
    "non-str weight key": saved(lambda p: p["weights"].__setitem__(0, torch.zeros(1))),
    "truthy non-dict base_manifest": saved(lambda p: p.__setitem__("base_manifest", 1.5)),
    "tensor config value": saved(lambda p: p["config"].__setitem__("lora_rank", torch.tensor([32, 32]))),
    "newline in a weight name": saved(lambda p: p["weights"].__setitem__("head.decision.weight\nhead.x", torch.zeros(1))),
    "pickle memo KeyError in torch.load": lambda source: crafted_pickle(b"\x80\x02h\x05."),
    "pickle stack IndexError in torch.load": lambda source: crafted_pickle(b"\x80\x02)R."),
}


@pytest.mark.parametrize("case", sorted(KNOWN_CRASHES))
def test_former_reader_crashes_are_clean_refusals(source, case):
    outcome = read_checkpoint(source, KNOWN_CRASHES[case](source))
    assert outcome != "ok" and "\n" not in outcome
