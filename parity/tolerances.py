"""Declared parity tolerances (`manifests/tolerances.json`): schema, validation, selection.

One entry per LoRA mode x dtype x device x execution mode. Every entry states, before any
comparison runs, what counts as a pass, and why. The harness reports every metric
and fails only on these.

File layout (schema `valen-parity-tolerances/1`):

    {"schema": "valen-parity-tolerances/1",
     "description": "...",
     "entries": [{"lora": "separate", "dtype": "bf16", "device": "cpu", "mode": "per-branch",
                  "max_abs_dp": 1e-6, "max_abs_dconfidence": 2e-6, "max_abs_dscore": 1e-5,
                  "decision_margin": 2e-6, "pixel_values_max_abs": 0.0,
                  "answer_formula_max_abs": 0.0, "token_ids": "exact", "usage": "exact",
                  "status": "measured", "measured": {...}, "why": "..."}]}

Keys of an entry:
- `max_abs_dp`: max over candidates of |p_ref - p_runtime| (probabilities from each side's own
  logits by the §10 formula).
- `max_abs_dconfidence`: |confidence_ref - confidence_runtime| (choice and score).
- `max_abs_dscore`: |score_ref - score_runtime| (score questions; sum of i * p_i).
- `decision_margin`: the decisions (first argmax) must agree wherever the reference's top-two
  probability margin is at least this.
- `pixel_values_max_abs`: max |Δ| between the processor's and the runtime's pixel_values.
- `answer_formula_max_abs`: max |Δ| between the runtime's response numbers and the §10 formula
  applied to the runtime's own logits (catches answer-formatting bugs).
- `token_ids`, `usage`: always "exact" (prompt token ids, positions, keys; input/compute tokens).
- `status`: "measured", or a string starting with "provisional" (declared before any
  measurement on that device); `measured`: optional object of numbers from the runs the entry
  was set from; `why`: one line, required.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from valen_runtime.safetensors_file import reject_duplicate_keys

SCHEMA = "valen-parity-tolerances/1"
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "manifests" / "tolerances.json"

AXES = {
    "lora": ("separate", "merged"),
    "dtype": ("fp32", "bf16"),
    "device": ("cpu", "cuda"),
    "mode": ("per-branch", "shared-prefix"),
}
NUMBERS = (
    "max_abs_dp",
    "max_abs_dconfidence",
    "max_abs_dscore",
    "decision_margin",
    "pixel_values_max_abs",
    "answer_formula_max_abs",
)
EXACT = ("token_ids", "usage")
REQUIRED = tuple(AXES) + NUMBERS + EXACT + ("status", "why")
OPTIONAL = ("measured",)
TOP_LEVEL = ("schema", "description", "entries")


class ToleranceError(ValueError):
    """The tolerance file is malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Tolerance:
    lora: str
    dtype: str
    device: str
    mode: str
    max_abs_dp: float
    max_abs_dconfidence: float
    max_abs_dscore: float
    decision_margin: float
    pixel_values_max_abs: float
    answer_formula_max_abs: float
    status: str
    why: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.lora, self.dtype, self.device, self.mode)

    @property
    def provisional(self) -> bool:
        return self.status != "measured"

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in tuple(AXES) + NUMBERS + ("status", "why")} | {"token_ids": "exact", "usage": "exact"}


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToleranceError(f"{where}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ToleranceError(f"{where}: must be finite, got {value!r}")
    if value < 0:
        raise ToleranceError(f"{where}: must not be negative, got {value!r}")
    return float(value)


def _reject_constant(name):
    raise ToleranceError(f"{name} is not a finite number")


def validate(data, source: str = "tolerances") -> list[Tolerance]:
    """Check a parsed tolerance file; returns its entries. Raises ToleranceError with a clear message."""
    if not isinstance(data, dict):
        raise ToleranceError(f"{source}: the top level must be an object")
    unknown = sorted(set(data) - set(TOP_LEVEL))
    if unknown:
        raise ToleranceError(f"{source}: unknown top-level key(s) {unknown}; allowed: {list(TOP_LEVEL)}")
    if data.get("schema") != SCHEMA:
        raise ToleranceError(f"{source}: schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    entries = data.get("entries")
    if not isinstance(entries, list) or not entries:
        raise ToleranceError(f"{source}: entries must be a non-empty list")
    out: list[Tolerance] = []
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: entries[{i}]"
        if not isinstance(entry, dict):
            raise ToleranceError(f"{where}: must be an object")
        unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise ToleranceError(f"{where}: unknown key(s) {unknown}")
        missing = [k for k in REQUIRED if k not in entry]
        if missing:
            raise ToleranceError(f"{where}: missing key(s) {missing}")
        for axis, allowed in AXES.items():
            if entry[axis] not in allowed:
                raise ToleranceError(f"{where}.{axis}: {entry[axis]!r} is not one of {list(allowed)}")
        where = f"{source}: entry {entry['lora']}/{entry['dtype']}/{entry['device']}/{entry['mode']}"
        why = entry["why"]
        if not isinstance(why, str) or not why.strip():
            raise ToleranceError(f"{where}: why must be a non-empty one-line string")
        if "\n" in why:
            raise ToleranceError(f"{where}: why must be one line")
        status = entry["status"]
        if not isinstance(status, str) or not (status == "measured" or status.startswith("provisional")):
            raise ToleranceError(f"{where}: status must be 'measured' or start with 'provisional', got {status!r}")
        for k in EXACT:
            if entry[k] != "exact":
                raise ToleranceError(f"{where}.{k}: must be \"exact\", got {entry[k]!r}")
        numbers = {k: _number(entry[k], f"{where}.{k}") for k in NUMBERS}
        if numbers["max_abs_dp"] > 1:
            raise ToleranceError(f"{where}.max_abs_dp: {numbers['max_abs_dp']} exceeds 1; a probability gate above 1 checks nothing")
        if "measured" in entry:
            m = entry["measured"]
            if not isinstance(m, dict):
                raise ToleranceError(f"{where}.measured: must be an object")
            for k, v in m.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    _number(v, f"{where}.measured.{k}")
        tol = Tolerance(entry["lora"], entry["dtype"], entry["device"], entry["mode"], status=status, why=why.strip(), **numbers)
        if tol.key in seen:
            raise ToleranceError(f"{where}: duplicates entries[{seen[tol.key]}]")
        seen[tol.key] = i
        out.append(tol)
    return out


def load(path: Path | str = DEFAULT_PATH) -> list[Tolerance]:
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


def select(entries: list[Tolerance], lora: str, dtype: str, device: str, mode: str) -> Tolerance:
    device = device.split(":", 1)[0]
    for t in entries:
        if t.key == (lora, dtype, device, mode):
            return t
    raise ToleranceError(f"no tolerance declared for lora={lora} dtype={dtype} device={device} mode={mode}")
