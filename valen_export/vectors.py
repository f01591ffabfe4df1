"""Conformance vectors (`valen-native-vectors/1`) for one export: numeric probes a native reader recomputes.

    valen-vectors EXPORT_DIR OUT.json [--seed 0]

Writes, for fresh FP32 inputs drawn from `--seed`: one embedding row; the head logits for
candidate rows and a decision row; three LoRA-adjusted projections (the first linear-attention
layer's in_proj_qkv, the first full-attention layer's o_proj, the last layer's down_proj) in
the export's own LoRA mode. Expected values are computed in float64 straight from the
safetensors files (the `safetensors` package and torch, nothing from the runtime engine), and
each carries an error bound a float32 computation in any summation order must meet; the bound
is derived in docs/export-format.md ("Conformance vectors"). The same seed gives the same inputs
for every export of one config, so a separate and a merged export can be compared.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import click
import torch
from safetensors import safe_open

from valen_runtime.errors import ValenError

from . import tensor_table as table
from .errors import ExportError

FORMAT = "valen-native-vectors/1"
U32 = 2.0**-24  # unit round-off of float32 (round to nearest)
U64 = 2.0**-53  # unit round-off of float64
CANDIDATE_ROWS = 3
PROJECTION_ROWS = 2


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): bound on the relative error of n roundings."""
    return n * u / (1 - n * u)


def bound(condition: torch.Tensor, expected: torch.Tensor, roundings: int) -> torch.Tensor:
    """Per-element bound on |float32 result - expected| (docs/export-format.md, "Conformance vectors").

    condition: the sum of absolute values of the terms (float64); expected: the float64 result.
    gamma_n(fp32) covers the reader's float32 arithmetic, gamma_n(fp64) this file's float64
    arithmetic, 2^-51 |expected| a JSON parser off by up to two float64 ulps; the factor
    (1 + 2^-40) keeps the float64-computed bound an upper bound.
    """
    b = (gamma(roundings, U32) + gamma(roundings, U64)) * condition + 2.0**-51 * expected.abs()
    return b * (1 + 2.0**-40)


class _Export:
    """Tensors of an export by name, read with the `safetensors` package (values widened to float64)."""

    def __init__(self, root: Path):
        self.root = root
        self.manifest_bytes = (root / "valen_export.json").read_bytes()
        self.manifest = json.loads(self.manifest_bytes)
        if self.manifest.get("format") != "valen-native/1":
            raise ExportError(f"{root / 'valen_export.json'}: format {self.manifest.get('format')!r}, expected 'valen-native/1'")
        lang = self.manifest["language"]
        self.where: dict[str, str] = {}
        if lang["index"]:
            self.where.update(json.loads((root / lang["index"]).read_text())["weight_map"])
        else:
            with safe_open(root / lang["files"][0], framework="pt") as f:
                self.where.update({k: lang["files"][0] for k in f.keys()})
        if self.manifest["lora"]["file"]:
            with safe_open(root / self.manifest["lora"]["file"], framework="pt") as f:
                self.where.update({k: self.manifest["lora"]["file"] for k in f.keys()})
        with safe_open(root / self.manifest["head"]["file"], framework="pt") as f:
            self.where.update({k: self.manifest["head"]["file"] for k in f.keys()})
        self.config = json.loads((root / "config.json").read_text())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ExportError(f"{self.root}: no tensor {name}")
        with safe_open(self.root / self.where[name], framework="pt") as f:
            return f.get_tensor(name).double()

    def row(self, name: str, index: int) -> torch.Tensor:
        """One row, read alone (the 2B embedding is 1 GiB in BF16, 4 GiB as float64)."""
        if name not in self.where:
            raise ExportError(f"{self.root}: no tensor {name}")
        with safe_open(self.root / self.where[name], framework="pt") as f:
            return f.get_slice(name)[index : index + 1][0].double()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Fresh inputs rounded to float32 values, held in float64 (exact)."""
    return t.float().double()


def _rows(t: torch.Tensor) -> list:
    return t.tolist()


def _embedding(ex: _Export, cfg, gen: torch.Generator) -> dict:
    name = table.LANGUAGE_PREFIX + "embed_tokens.weight"
    token = int(torch.randint(cfg.text_config.vocab_size, (1,), generator=gen))
    row = ex.row(name, token)
    return {"tensor": name, "token_id": token, "expected": _rows(row), "bound": 0.0}


def _head(ex: _Export, cfg, gen: torch.Generator) -> dict:
    h = cfg.text_config.hidden_size
    head = ex.manifest["head"]
    p = head["projection_dim"]
    scale = head["logit_scale"]
    cand = _fp32(torch.randn(CANDIDATE_ROWS, h, generator=gen))
    dec = _fp32(torch.randn(h, generator=gen))
    wc, wd = ex.get("candidate.weight"), ex.get("decision.weight")
    logits = ((cand @ wc.T) * (wd @ dec)).sum(-1) * scale  # [K]
    condition = ((cand.abs() @ wc.abs().T) * (wd.abs() @ dec.abs())).sum(-1) * abs(scale)
    # Per term: h roundings on each side, one product, p-1 additions, the scale, its own rounding to fp32.
    n = 2 * h + p + 2
    return {
        "candidate_hidden": _rows(cand),
        "decision_hidden": _rows(dec),
        "logit_scale": scale,
        "expected_logits": _rows(logits),
        "roundings": n,
        "bound": _rows(bound(condition, logits, n)),
    }


def _probe_modules(cfg) -> list[str]:
    kinds = cfg.text_config.layer_types
    first_gdn = kinds.index(table.LINEAR_ATTENTION)
    first_full = kinds.index(table.FULL_ATTENTION)
    last = len(kinds) - 1
    return [f"layers.{first_gdn}.linear_attn.in_proj_qkv", f"layers.{first_full}.self_attn.o_proj", f"layers.{last}.mlp.down_proj"]


def _projection(ex: _Export, module: str, out_f: int, in_f: int, gen: torch.Generator) -> dict:
    lora = ex.manifest["lora"]
    weight = f"{table.LANGUAGE_PREFIX}{module}.weight"
    x = _fp32(torch.randn(PROJECTION_ROWS, in_f, generator=gen))
    w = ex.get(weight)
    y = x @ w.T
    condition = x.abs() @ w.abs().T
    n = in_f
    probe = {"module": module, "weight": weight, "mode": lora["mode"], "input": _rows(x)}
    if lora["mode"] == "separate":
        key = lora["key_prefix"] + module
        a_name, b_name = table.LORA_A.format(module=key), table.LORA_B.format(module=key)
        a, b, s = ex.get(a_name), ex.get(b_name), lora["scale"]
        y = y + s * ((x @ a.T) @ b.T)
        condition = condition + abs(s) * ((x.abs() @ a.abs().T) @ b.abs().T)
        # Per term: in roundings (x.A), r (B), the scale's own rounding to float32, the scaling, the final addition.
        n = in_f + a.shape[0] + 3
        probe.update(lora_a=a_name, lora_b=b_name, scale=s)
    else:
        probe.update(lora_a=None, lora_b=None, scale=None)
    probe.update(expected=_rows(y), roundings=n, bound=_rows(bound(condition, y, n)))
    return probe


def write_vectors(export_dir: Path, out: Path, seed: int = 0) -> dict:
    """Compute the vectors of `export_dir` and write them to `out` (JSON); returns the document."""
    export_dir, out = Path(export_dir), Path(out)
    if not (export_dir / "valen_export.json").is_file():
        raise ExportError(f"{export_dir / 'valen_export.json'}: missing; not an export directory")
    ex = _Export(export_dir)
    cfg = table.model_config(ex.config)
    gen = torch.Generator().manual_seed(seed)
    targets = table.lora_targets(cfg)
    doc = {
        "format": FORMAT,
        "manifest_sha256": hashlib.sha256(ex.manifest_bytes).hexdigest(),
        "lora_mode": ex.manifest["lora"]["mode"],
        "seed": seed,
        "embedding": _embedding(ex, cfg, gen),
        "head": _head(ex, cfg, gen),
        "projections": [_projection(ex, m, *targets[m], gen) for m in _probe_modules(cfg)],
    }
    for value in _walk_numbers(doc):
        if not math.isfinite(value):
            raise ExportError(f"{export_dir}: a conformance vector is not finite")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    tmp.replace(out)
    return doc


def _walk_numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _walk_numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk_numbers(v)
    elif isinstance(x, float):
        yield x


@click.command(name="valen-vectors")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the FP32 inputs (same seed, same inputs for every export of one config).")
def main(export_dir: Path, out: Path, seed: int) -> None:
    """Write the conformance vectors (valen-native-vectors/1) of EXPORT_DIR to OUT (JSON)."""
    try:
        write_vectors(export_dir, out, seed)
    except (ValenError, OSError, ValueError, KeyError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote {out}; check with: valen-native-check {export_dir} --vectors {out}")


if __name__ == "__main__":
    main()
