"""Declared parity gates (`manifests/tolerances.json`): schema, validation, selection.

Everything that decides pass or fail is declared in the file before any comparison runs; the
harness reports every metric and fails only on these. Layout (schema `valen-parity-tolerances/2`):

    {"schema": "valen-parity-tolerances/2",
     "description": "...",
     "gates": {                      # the three kinds of gate, each parameter with its reason
        "exact":          {"max_abs_dp": 1e-6, "decision_margin_factor": 2, "why": {...}},
        "fp32-rounding":  {"factor": 128, "floor": 1e-6, "decision_margin_factor": 2, "why": {...}},
        "truth-relative": {"a": 2, "b": 0.01, "margin_floor": 0.05, "margin_factor": 2,
                           "z": 3, "p95_spread": 1.45, "distribution_additive": 0.001, "min_questions": 100,
                           "why": {...}}},
     "checks": {"pixel_values_max_abs": 0, "rotary_max_abs": 0,
                "answer_formula_max_abs": {"cpu": 0, "cuda": 1e-6}, "why": {...}},
     "entries": [{"lora": "separate", "dtype": "bf16", "device": "cuda", "mode": "shared-prefix",
                  "gate": "truth-relative", "roundings": 1, "dual": "reference", "why": "...", "measured": {...}}]}

What the gates mean (the harness applies them in `parity.compare`; every comparison is `<=`):
- exact: per option |p_runtime - p_reference| <= max_abs_dp; the decisions agree wherever the
  reference's top-two margin >= decision_margin_factor * max_abs_dp.
- fp32-rounding: per option |p_runtime - p_reference| <= B with
  B = max(floor, factor * 2^-16 * E_bf16): E_bf16 is the bf16 reference's largest |Δp| against
  the fp32 reference on the same requests (how strongly this model amplifies a rounding), 2^-16
  the ratio of fp32's to bf16's unit roundoff (2^-24 / 2^-8), `factor` the fp32 roundings per bf16
  one (docs/parity.md); decisions agree wherever the reference's margin >= decision_margin_factor * B.
- truth-relative: per option |p_runtime - p_truth| <= a * Y + b (truth: the fp32 reference),
  Y = sqrt(roundings) * E_bf16, `roundings` the entry's count of independent bf16 roundings of
  E_bf16's kind the path carries (1: bf16 compute, or the merged weights alone; 2: both);
  decisions equal the truth's wherever its margin >= max(margin_floor, margin_factor * Y); with at
  least min_questions questions, the mean and the p95 over questions of the runtime's largest
  error are each <= f * sqrt(roundings) * the bf16 reference's + distribution_additive, with
  f = 1 + z * s * sqrt(2 / questions), s = 1 for the mean and p95_spread for the p95.
- dual (shared-prefix entries): the fp32 run of the same runtime options (the run itself for an
  fp32 entry) must also pass the fp32-rounding gate against an exact anchor: "reference", the fp32
  reference (separate LoRA); "module-path", the runtime's fp32 shared-prefix run with the PyTorch
  kernels on the same export (merged LoRA, where the pinned reference is no exact anchor: its LoRA
  is unmerged); skipped where that run is the anchor itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from valen_runtime.safetensors_file import reject_duplicate_keys

SCHEMA = "valen-parity-tolerances/2"
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "manifests" / "tolerances.json"

AXES = {
    "lora": ("separate", "merged"),
    "dtype": ("fp32", "bf16"),
    "device": ("cpu", "cuda"),
    "mode": ("per-branch", "shared-prefix"),
}
GATE_PARAMETERS = {
    "exact": ("max_abs_dp", "decision_margin_factor"),
    "fp32-rounding": ("factor", "floor", "decision_margin_factor"),
    "truth-relative": ("a", "b", "margin_floor", "margin_factor", "z", "p95_spread", "distribution_additive", "min_questions"),
}
CHECK_NUMBERS = ("pixel_values_max_abs", "rotary_max_abs")
ENTRY_KEYS = tuple(AXES) + ("gate", "dual", "why")
ENTRY_OPTIONAL = ("measured", "roundings")
DUAL_ANCHORS = ("reference", "module-path")
TOP_LEVEL = ("schema", "description", "gates", "checks", "entries")
# Bounds on probabilities above 1 check nothing.
PROBABILITY_PARAMETERS = ("max_abs_dp", "floor", "b", "margin_floor", "distribution_additive")


class ToleranceError(ValueError):
    """The tolerance file is malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Gate:
    """The declared gate for one combination (LoRA mode x dtype x device x execution mode)."""

    lora: str
    dtype: str
    device: str
    mode: str
    kind: str  # "exact" | "fp32-rounding" | "truth-relative"
    dual: str | None  # the anchor of the fp32 check: "reference" | "module-path" | None
    params: dict  # the kind's parameters (GATE_PARAMETERS[kind])
    pixel_values_max_abs: float
    rotary_max_abs: float
    answer_formula_max_abs: float
    why: str
    reasons: dict = field(default_factory=dict)  # parameter -> why, from the file
    roundings: int = 1  # truth-relative: independent bf16 roundings of E_bf16's kind in the path
    dual_gate: "Gate | None" = None  # the fp32-rounding gate of the dual check

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.lora, self.dtype, self.device, self.mode)

    def __getitem__(self, name: str) -> float:
        return self.params[name]

    @property
    def needs_bf16_yardstick(self) -> bool:
        """fp32-rounding and truth-relative bounds scale with the bf16 reference's own error."""
        return self.kind in ("fp32-rounding", "truth-relative")

    def to_json(self) -> dict:
        return {
            "lora": self.lora, "dtype": self.dtype, "device": self.device, "mode": self.mode,
            "gate": self.kind, "dual": self.dual, "parameters": dict(self.params), "roundings": self.roundings,
            "checks": {"token_ids": "exact", "usage": "exact", "pixel_values_max_abs": self.pixel_values_max_abs,
                       "rotary_max_abs": self.rotary_max_abs, "answer_formula_max_abs": self.answer_formula_max_abs},
            "why": self.why, "reasons": dict(self.reasons),
        }


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToleranceError(f"{where}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ToleranceError(f"{where}: must be finite, got {value!r}")
    if value < 0:
        raise ToleranceError(f"{where}: must not be negative, got {value!r}")
    return float(value)


def _one_line(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ToleranceError(f"{where}: must be a non-empty one-line string")
    if "\n" in value:
        raise ToleranceError(f"{where}: must be one line")
    return value.strip()


def _require_keys(block: dict, required, optional, where: str) -> None:
    """Exactly the required keys, plus any of the optional ones: one line naming the rest."""
    unknown = sorted(set(block) - set(required) - set(optional))
    if unknown:
        raise ToleranceError(f"{where}: unknown key(s) {unknown}")
    missing = [k for k in required if k not in block]
    if missing:
        raise ToleranceError(f"{where}: missing key(s) {missing}")


def _reasons(block: dict, names: tuple[str, ...], where: str) -> dict:
    why = block.get("why")
    if not isinstance(why, dict):
        raise ToleranceError(f"{where}.why: must be an object giving the reason for each of {list(names)}")
    missing = [n for n in names if n not in why]
    if missing:
        raise ToleranceError(f"{where}.why: no reason given for {missing}")
    unknown = sorted(set(why) - set(names))
    if unknown:
        raise ToleranceError(f"{where}.why: reasons for unknown parameter(s) {unknown}")
    return {n: _one_line(why[n], f"{where}.why.{n}") for n in names}


def _gates(data, source: str) -> dict[str, tuple[dict, dict]]:
    gates = data.get("gates")
    if not isinstance(gates, dict):
        raise ToleranceError(f"{source}: gates must be an object with {list(GATE_PARAMETERS)}")
    if sorted(gates) != sorted(GATE_PARAMETERS):
        raise ToleranceError(f"{source}: gates must declare exactly {list(GATE_PARAMETERS)}, got {sorted(gates)}")
    out = {}
    for kind, names in GATE_PARAMETERS.items():
        where = f"{source}: gates.{kind}"
        block = gates[kind]
        if not isinstance(block, dict):
            raise ToleranceError(f"{where}: must be an object")
        _require_keys(block, names, ("why",), where)
        params = {n: _number(block[n], f"{where}.{n}") for n in names}
        for n in names:
            if n in PROBABILITY_PARAMETERS and params[n] > 1:
                raise ToleranceError(f"{where}.{n}: {params[n]} exceeds 1; a probability bound above 1 checks nothing")
        if kind == "truth-relative" and params["min_questions"] != int(params["min_questions"]):
            raise ToleranceError(f"{where}.min_questions: must be a whole number, got {params['min_questions']}")
        out[kind] = (params, _reasons(block, names, where))
    return out


def _checks(data, source: str) -> tuple[dict, dict]:
    where = f"{source}: checks"
    checks = data.get("checks")
    if not isinstance(checks, dict):
        raise ToleranceError(f"{where}: must be an object")
    names = CHECK_NUMBERS + ("answer_formula_max_abs",)
    _require_keys(checks, names, ("why",), where)
    values = {n: _number(checks[n], f"{where}.{n}") for n in CHECK_NUMBERS}
    formula = checks["answer_formula_max_abs"]
    if not isinstance(formula, dict) or sorted(formula) != sorted(AXES["device"]):
        raise ToleranceError(f"{where}.answer_formula_max_abs: must be an object with one bound per device {list(AXES['device'])}")
    values["answer_formula_max_abs"] = {d: _number(formula[d], f"{where}.answer_formula_max_abs.{d}") for d in AXES["device"]}
    return values, _reasons(checks, names, where)


def validate(data, source: str = "tolerances") -> list[Gate]:
    """Check a parsed tolerance file; returns one Gate per entry. Raises ToleranceError naming the problem."""
    if not isinstance(data, dict):
        raise ToleranceError(f"{source}: the top level must be an object")
    unknown = sorted(set(data) - set(TOP_LEVEL))
    if unknown:
        raise ToleranceError(f"{source}: unknown top-level key(s) {unknown}; allowed: {list(TOP_LEVEL)}")
    if data.get("schema") != SCHEMA:
        raise ToleranceError(f"{source}: schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    gates = _gates(data, source)
    checks, check_reasons = _checks(data, source)
    entries = data.get("entries")
    if not isinstance(entries, list) or not entries:
        raise ToleranceError(f"{source}: entries must be a non-empty list")
    out: list[Gate] = []
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: entries[{i}]"
        if not isinstance(entry, dict):
            raise ToleranceError(f"{where}: must be an object")
        _require_keys(entry, ENTRY_KEYS, ENTRY_OPTIONAL, where)
        for axis, allowed in AXES.items():
            if entry[axis] not in allowed:
                raise ToleranceError(f"{where}.{axis}: {entry[axis]!r} is not one of {list(allowed)}")
        where = f"{source}: entry {entry['lora']}/{entry['dtype']}/{entry['device']}/{entry['mode']}"
        why = _one_line(entry["why"], f"{where}.why")
        kind = entry["gate"]
        if kind not in GATE_PARAMETERS:
            raise ToleranceError(f"{where}.gate: {kind!r} is not one of {list(GATE_PARAMETERS)}")
        dual = entry["dual"]
        if dual is not None and dual not in DUAL_ANCHORS:
            raise ToleranceError(f"{where}.dual: {dual!r} is not null or one of {list(DUAL_ANCHORS)}")
        if dual is not None and entry["mode"] != "shared-prefix":
            raise ToleranceError(f"{where}.dual: only a shared-prefix entry has a fast path to check in fp32")
        roundings = entry.get("roundings", 1)
        if "roundings" in entry and kind != "truth-relative":
            raise ToleranceError(f"{where}.roundings: only a truth-relative entry counts roundings")
        if isinstance(roundings, bool) or not isinstance(roundings, int) or roundings < 1:
            raise ToleranceError(f"{where}.roundings: must be a whole number >= 1, got {roundings!r}")
        if "measured" in entry and not isinstance(entry["measured"], dict):
            raise ToleranceError(f"{where}.measured: must be an object")
        params, reasons = gates[kind]
        checks_args = (checks["pixel_values_max_abs"], checks["rotary_max_abs"], checks["answer_formula_max_abs"][entry["device"]])
        all_reasons = {f"checks.{k}": v for k, v in check_reasons.items()}
        dual_gate = None
        if dual is not None:
            fp32_params, fp32_reasons = gates["fp32-rounding"]
            anchor = "the fp32 reference" if dual == "reference" else "the runtime's fp32 shared-prefix run with the PyTorch kernels on the same export"
            dual_gate = Gate(entry["lora"], "fp32", entry["device"], entry["mode"], "fp32-rounding", None, dict(fp32_params), *checks_args,
                             f"dual check: the fp32 run of the same options against {anchor}", dict(fp32_reasons) | all_reasons)
        gate = Gate(
            entry["lora"], entry["dtype"], entry["device"], entry["mode"], kind, dual, dict(params), *checks_args,
            why, dict(reasons) | all_reasons, roundings, dual_gate,
        )
        if gate.key in seen:
            raise ToleranceError(f"{where}: duplicates entries[{seen[gate.key]}]")
        seen[gate.key] = i
        out.append(gate)
    return out


def _reject_constant(name):
    raise ToleranceError(f"{name} is not a finite number")


def load(path: Path | str = DEFAULT_PATH) -> list[Gate]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ToleranceError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = json.loads(text, object_pairs_hook=reject_duplicate_keys, parse_constant=_reject_constant)
    except ToleranceError:
        raise
    except ValueError as e:  # malformed JSON, or a duplicate key
        raise ToleranceError(f"{path}: not valid JSON ({e})") from None
    return validate(data, str(path))


def select(entries: list[Gate], lora: str, dtype: str, device: str, mode: str) -> Gate:
    device = device.split(":", 1)[0]
    for g in entries:
        if g.key == (lora, dtype, device, mode):
            return g
    raise ToleranceError(f"no tolerance declared for lora={lora} dtype={dtype} device={device} mode={mode}")
