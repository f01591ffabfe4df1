//! Conformance vectors `valen-native-vectors/1` (export-format §14): recompute each probe
//! from the export in f32, compare within the file's bound, and check that bound against
//! the doc's round-off formula so a loose file cannot pass a wrong export.

use std::path::Path;

use serde_json::Value;

use crate::check::Export;
use crate::head::{self, CANDIDATE, DECISION};
use crate::json::{self, show, Obj};
use crate::manifest::LoraMode;
use crate::report::Problems;
use crate::safetensors::{Dtype, MappedFile};
use crate::shapes::{self, LoraTarget, LANGUAGE_PREFIX};

pub const FORMAT: &str = "valen-native-vectors/1";
const MAX_LEN: u64 = 256 << 20;

/// Both sides compute C in float64 over at most ~10^6 terms, so their values differ by a
/// relative 2·γ_(10^6)(2^-53) < 3e-10 at most; a file bound above ours by more is too loose.
const BOUND_SLACK: f64 = 1e-9;

/// Checks the vectors file against the export; one line per failed probe.
pub fn check(path: &Path, export: &Export, problems: &mut Problems) {
    let label = path.display().to_string();
    let lines = run(path, export).unwrap_or_else(|e| vec![e]);
    for line in lines {
        problems.push(format!("{label}: {line}"));
    }
}

fn run(path: &Path, export: &Export) -> Result<Vec<String>, String> {
    let value = json::read_strict(path, MAX_LEN)?;
    let root = Obj::root(&value, "the vectors file")?;
    let format = root.get("format")?;
    if format.as_str() != Some(FORMAT) {
        return Err(format!(
            "format: expected exactly {FORMAT:?}, found {}",
            show(format)
        ));
    }
    let sha = root.str("manifest_sha256")?;
    if sha != export.manifest_sha256 {
        return Err(format!(
            "manifest_sha256 {sha} is not the SHA-256 of this export's valen_export.json ({})",
            export.manifest_sha256
        ));
    }
    let mode = export.manifest.lora.mode.name();
    root.expect_str("lora_mode", mode)?;
    root.uint("seed")?;

    let mut lines = Vec::new();
    let mut add = |result: Result<Vec<String>, String>| match result {
        Ok(found) => lines.extend(found),
        Err(e) => lines.push(e),
    };
    add(root
        .obj("embedding", "embedding")
        .and_then(|o| embedding(o, export)));
    add(root.obj("head", "head").and_then(|o| head_probe(o, export)));
    add(projections(root.array("projections")?, export));
    Ok(lines)
}

// ---- numerics ----

/// `w·x` for row-major `w` [rows, x.len()], accumulated in f32.
pub fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// `|w|·|x|` in f64: the C of the round-off bound for one matrix-vector product.
fn abs_matvec(w: &[f32], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|row| {
            row.iter()
                .zip(x)
                .map(|(a, b)| (*a as f64).abs() * b.abs())
                .sum()
        })
        .collect()
}

/// γ_n(u) = n·u / (1 − n·u) (Higham §3.1).
fn gamma(n: u64, u: f64) -> f64 {
    let nu = n as f64 * u;
    nu / (1.0 - nu)
}

/// §14: `(γ_n(2^-24) + γ_n(2^-53))·C + 2^-51·|expected|`, times `1 + 2^-40`.
pub fn doc_bound(n: u64, c: f64, expected: f64) -> f64 {
    let (u32_, u64_) = (2f64.powi(-24), 2f64.powi(-53));
    ((gamma(n, u32_) + gamma(n, u64_)) * c + 2f64.powi(-51) * expected.abs())
        * (1.0 + 2f64.powi(-40))
}

/// One line if any `got` is off `expected` by more than `bound`, one if the file's bound
/// exceeds ours. `cols` only shapes the reported index.
fn compare(
    what: &str,
    got: &[f32],
    expected: &[f64],
    bound: &[f64],
    ours: &[f64],
    cols: usize,
) -> Vec<String> {
    let at = |i: usize| match i.checked_div(cols) {
        None => format!("[{i}]"),
        Some(row) => format!("[{row}][{}]", i % cols),
    };
    let mut lines = Vec::new();
    // A NaN result counts as off.
    let off: Vec<usize> = (0..got.len())
        .filter(|&i| {
            let diff = (got[i] as f64 - expected[i]).abs();
            diff.is_nan() || diff > bound[i]
        })
        .collect();
    if let Some(&i) = off.first() {
        lines.push(format!(
            "{what}: {} of {} values differ from expected beyond the bound; first {}: computed {}, expected {}, bound {:e}",
            off.len(),
            got.len(),
            at(i),
            got[i],
            expected[i],
            bound[i]
        ));
    }
    if let Some(i) = (0..bound.len()).find(|&i| bound[i] > ours[i] * (1.0 + BOUND_SLACK)) {
        lines.push(format!(
            "{what}: bound{} = {:e} is larger than section 14's formula gives ({:e})",
            at(i),
            bound[i],
            ours[i]
        ));
    }
    lines
}

// ---- reading the file ----

/// A number that must be exactly a float32 value (§14: inputs are written that way).
fn exact_f32(v: &Value, path: &str) -> Result<f32, String> {
    let x = v
        .as_f64()
        .ok_or_else(|| format!("{path}: expected a number, found {}", show(v)))?;
    if (x as f32) as f64 != x {
        return Err(format!("{path}: {x} is not exactly a float32 value"));
    }
    Ok(x as f32)
}

fn list<'a>(v: &'a Value, path: &str, len: usize) -> Result<&'a Vec<Value>, String> {
    let items = v
        .as_array()
        .ok_or_else(|| format!("{path}: expected an array, found {}", show(v)))?;
    if items.len() != len {
        return Err(format!("{path}: {} entries, expected {len}", items.len()));
    }
    Ok(items)
}

fn f32_row(v: &Value, path: &str, len: usize) -> Result<Vec<f32>, String> {
    list(v, path, len)?
        .iter()
        .enumerate()
        .map(|(i, x)| exact_f32(x, &format!("{path}[{i}]")))
        .collect()
}

fn f64_row(v: &Value, path: &str, len: usize) -> Result<Vec<f64>, String> {
    let items = list(v, path, len)?;
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_f64()
                .ok_or_else(|| format!("{path}[{i}]: expected a number, found {}", show(x)))
        })
        .collect()
}

/// `rows` x `cols` numbers, flattened row-major; `rows` None accepts any count >= 1.
fn matrix<T>(
    v: &Value,
    path: &str,
    rows: Option<usize>,
    cols: usize,
    row: fn(&Value, &str, usize) -> Result<Vec<T>, String>,
) -> Result<(usize, Vec<T>), String> {
    let items = v
        .as_array()
        .ok_or_else(|| format!("{path}: expected an array, found {}", show(v)))?;
    if items.is_empty() || rows.is_some_and(|r| r != items.len()) {
        return Err(format!(
            "{path}: {} rows, expected {}",
            items.len(),
            rows.map_or("at least 1".into(), |r| r.to_string())
        ));
    }
    let mut flat = Vec::with_capacity(items.len() * cols);
    for (r, item) in items.iter().enumerate() {
        flat.extend(row(item, &format!("{path}[{r}]"), cols)?);
    }
    Ok((items.len(), flat))
}

/// A whole tensor as f32, after checking its dtype and shape.
fn tensor(
    file: Option<&MappedFile>,
    file_name: &str,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
) -> Result<Vec<f32>, String> {
    let file =
        file.ok_or_else(|| format!("{file_name} could not be read, so {name} is not available"))?;
    let info = file
        .header
        .tensors
        .get(name)
        .ok_or_else(|| format!("{file_name} has no tensor {name}"))?;
    if info.dtype != dtype || info.shape != shape {
        return Err(format!(
            "{file_name}: {name} is not {dtype} {shape:?}, cannot probe it"
        ));
    }
    file.to_f32(info)
}

// ---- probes ----

fn embedding(obj: Obj, export: &Export) -> Result<Vec<String>, String> {
    let name = format!("{LANGUAGE_PREFIX}embed_tokens.weight");
    obj.expect_str("tensor", &name)?;
    let text = &export.config.text;
    let token = obj.uint("token_id")? as usize;
    if token >= text.vocab_size {
        return Err(format!(
            "embedding.token_id: {token} is not below text_config.vocab_size {}",
            text.vocab_size
        ));
    }
    let expected = f64_row(obj.get("expected")?, "embedding.expected", text.hidden_size)?;
    let bound = obj.number("bound")?;
    if bound != 0.0 {
        return Err(format!(
            "embedding.bound: expected 0 (the row is compared exactly), found {bound}"
        ));
    }
    let (file, info) = export
        .language
        .get(&name)
        .ok_or_else(|| format!("no language file holds {name}"))?;
    if info.dtype != Dtype::BF16 || info.shape != [text.vocab_size, text.hidden_size] {
        return Err(format!(
            "{name} is not BF16 [vocab, hidden], cannot probe it"
        ));
    }
    let row = file.row_f32(info, token)?;
    let zeros = vec![0.0; row.len()];
    Ok(compare(
        &format!("embedding row {token}"),
        &row,
        &expected,
        &zeros,
        &zeros,
        0,
    ))
}

fn head_probe(obj: Obj, export: &Export) -> Result<Vec<String>, String> {
    let h = export.config.text.hidden_size;
    let p = export.manifest.head.projection_dim;
    let scale = export.manifest.head.logit_scale;
    if obj.number("logit_scale")? != scale {
        return Err(format!("head.logit_scale: expected the manifest's {scale}"));
    }
    let (k, candidates) = matrix(
        obj.get("candidate_hidden")?,
        "head.candidate_hidden",
        None,
        h,
        f32_row,
    )?;
    let decision = f32_row(obj.get("decision_hidden")?, "head.decision_hidden", h)?;
    let expected = f64_row(obj.get("expected_logits")?, "head.expected_logits", k)?;
    let bound = f64_row(obj.get("bound")?, "head.bound", k)?;
    let n = (2 * h + p + 2) as u64;
    if obj.uint("roundings")? != n {
        return Err(format!("head.roundings: expected 2H + P + 2 = {n}"));
    }
    let file = export.head.as_ref();
    let w_c = tensor(
        file,
        "valen_head.safetensors",
        CANDIDATE,
        Dtype::F32,
        &[p, h],
    )?;
    let w_d = tensor(
        file,
        "valen_head.safetensors",
        DECISION,
        Dtype::F32,
        &[p, h],
    )?;
    let rows: Vec<Vec<f32>> = candidates.chunks_exact(h).map(<[f32]>::to_vec).collect();
    let got = head::logits(&w_c, &w_d, &rows, &decision, scale);

    let decision_abs: Vec<f64> = decision.iter().map(|&x| x as f64).collect();
    let d_abs = abs_matvec(&w_d, &decision_abs);
    let ours: Vec<f64> = rows
        .iter()
        .zip(&expected)
        .map(|(row, &e)| {
            let row: Vec<f64> = row.iter().map(|&x| x as f64).collect();
            let c_abs = abs_matvec(&w_c, &row);
            let c = scale.abs() * c_abs.iter().zip(&d_abs).map(|(a, b)| a * b).sum::<f64>();
            doc_bound(n, c, e)
        })
        .collect();
    Ok(compare("head logits", &got, &expected, &bound, &ours, 0))
}

fn projections(items: &[Value], export: &Export) -> Result<Vec<String>, String> {
    let mut probed: Vec<String> = Vec::new();
    let mut lines = Vec::new();
    for (k, item) in items.iter().enumerate() {
        let path = format!("projections[{k}]");
        let obj = item.as_object().map(|map| Obj { path: &path, map });
        let obj = obj.ok_or_else(|| format!("{path}: expected an object"))?;
        match projection(obj, export) {
            Ok((module, found)) => {
                probed.push(module);
                lines.extend(found);
            }
            Err(e) => lines.push(e),
        }
    }
    // §14: any non-empty list of distinct LoRA targets.
    if items.is_empty() {
        lines.push("projections: expected at least one probe".to_string());
    }
    probed.sort();
    if let Some(pair) = probed.windows(2).find(|w| w[0] == w[1]) {
        lines.push(format!("projections: {} is probed twice", pair[0]));
    }
    Ok(lines)
}

fn projection(obj: Obj, export: &Export) -> Result<(String, Vec<String>), String> {
    let module = obj.str("module")?.to_string();
    let target: LoraTarget = shapes::lora_targets(&export.config)
        .into_iter()
        .find(|t| t.module == module)
        .ok_or_else(|| {
            format!(
                "{}: {module:?} is not a LoRA target of this config",
                obj.field_path("module")
            )
        })?;
    obj.expect_str("weight", &target.weight)?;
    let lora = &export.manifest.lora;
    obj.expect_str("mode", lora.mode.name())?;
    let (out, inp) = (target.out_features, target.in_features);
    let (rows, input) = matrix(
        obj.get("input")?,
        &obj.field_path("input"),
        None,
        inp,
        f32_row,
    )?;
    let (_, expected) = matrix(
        obj.get("expected")?,
        &obj.field_path("expected"),
        Some(rows),
        out,
        f64_row,
    )?;
    let (_, bound) = matrix(
        obj.get("bound")?,
        &obj.field_path("bound"),
        Some(rows),
        out,
        f64_row,
    )?;

    let (file, info) = export
        .language
        .get(&target.weight)
        .ok_or_else(|| format!("no language file holds {}", target.weight))?;
    if info.dtype != Dtype::BF16 || info.shape != [out, inp] {
        return Err(format!(
            "{} is not BF16 [{out}, {inp}], cannot probe it",
            target.weight
        ));
    }
    let w = file.to_f32(info)?;
    let (n, got, c) = match lora.mode {
        LoraMode::Merged => {
            for key in ["lora_a", "lora_b", "scale"] {
                if !obj.get(key)?.is_null() {
                    return Err(format!(
                        "{}: expected null in merged mode",
                        obj.field_path(key)
                    ));
                }
            }
            let got: Vec<f32> = input
                .chunks_exact(inp)
                .flat_map(|x| matvec(&w, x))
                .collect();
            let c: Vec<f64> = input
                .chunks_exact(inp)
                .flat_map(|x| abs_matvec(&w, &widen(x)))
                .collect();
            (inp as u64, got, c)
        }
        LoraMode::Separate => {
            obj.expect_str("lora_a", &target.lora_a)?;
            obj.expect_str("lora_b", &target.lora_b)?;
            if obj.number("scale")? != lora.scale {
                return Err(format!(
                    "{}: expected lora.scale {}",
                    obj.field_path("scale"),
                    lora.scale
                ));
            }
            let r = lora.rank;
            let adapter = export.adapter.as_ref();
            let a = tensor(
                adapter,
                "adapter_model.safetensors",
                &target.lora_a,
                Dtype::F32,
                &[r, inp],
            )?;
            let b = tensor(
                adapter,
                "adapter_model.safetensors",
                &target.lora_b,
                Dtype::F32,
                &[out, r],
            )?;
            let got = input
                .chunks_exact(inp)
                .flat_map(|x| separate(&w, &a, &b, lora.scale, x))
                .collect();
            let c = input
                .chunks_exact(inp)
                .flat_map(|x| {
                    let x = widen(x);
                    let base = abs_matvec(&w, &x);
                    let low = abs_matvec(&b, &abs_matvec(&a, &x));
                    base.into_iter()
                        .zip(low)
                        .map(|(p, q)| p + lora.scale.abs() * q)
                        .collect::<Vec<_>>()
                })
                .collect();
            // in for A·x, rank for B·(·), the scale's rounding to f32, the multiplication
            // by it, the final addition (this code rounds the scale product once, from f64).
            ((inp + r + 3) as u64, got, c)
        }
    };
    if obj.uint("roundings")? != n {
        return Err(format!("{}: expected {n}", obj.field_path("roundings")));
    }
    let ours: Vec<f64> = c
        .iter()
        .zip(&expected)
        .map(|(&c, &e)| doc_bound(n, c, e))
        .collect();
    let what = format!("projection {module} ({})", lora.mode.name());
    Ok((module, compare(&what, &got, &expected, &bound, &ours, out)))
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// `W·x + scale·B·(A·x)` in f32 (§5), the scale applied with one rounding.
pub fn separate(w: &[f32], a: &[f32], b: &[f32], scale: f64, x: &[f32]) -> Vec<f32> {
    let low = matvec(b, &matvec(a, x));
    matvec(w, x)
        .into_iter()
        .zip(low)
        .map(|(base, l)| base + (l as f64 * scale) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matvec_is_row_major() {
        // [[1, 2, 3], [4, 5, 6]] · [1, 0, -1] = [-2, -2]
        assert_eq!(
            matvec(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[1.0, 0.0, -1.0]),
            vec![-2.0, -2.0]
        );
    }

    #[test]
    fn separate_projection_adds_the_scaled_low_rank_term() {
        // W = I (2x2), A = [1, 1] (rank 1), B = [[1], [2]], x = [1, 2]: A·x = 3, B·3 = [3, 6].
        let y = separate(
            &[1.0, 0.0, 0.0, 1.0],
            &[1.0, 1.0],
            &[1.0, 2.0],
            0.5,
            &[1.0, 2.0],
        );
        assert_eq!(y, vec![2.5, 5.0]);
    }

    #[test]
    fn bound_follows_the_formula() {
        // n = 1, C = 1, expected = 0: γ_1(2^-24) + γ_1(2^-53), times 1 + 2^-40.
        let u = 2f64.powi(-24);
        let v = 2f64.powi(-53);
        let want = (u / (1.0 - u) + v / (1.0 - v)) * (1.0 + 2f64.powi(-40));
        assert_eq!(doc_bound(1, 1.0, 0.0), want);
        assert!(doc_bound(100, 2.0, 0.0) > 2.0 * doc_bound(100, 1.0, 0.0) * 0.999);
    }

    #[test]
    fn inputs_must_be_exact_float32() {
        // The shortest decimal of a float32 read back as f64 (needs a correctly rounded
        // parser: serde_json's default one reads this value one ulp off).
        let v = json::parse_strict("[-1.5550950765609741]").unwrap();
        assert_eq!(exact_f32(&v[0], "x").unwrap().to_bits(), 0xbfc7_0d5b);
        assert!(exact_f32(&serde_json::json!(0.1), "x")
            .unwrap_err()
            .contains("not exactly a float32"));
    }

    #[test]
    fn compare_reports_values_and_loose_bounds_once() {
        let lines = compare("p", &[1.0, 2.0], &[1.0, 2.5], &[0.1, 0.1], &[0.1, 0.1], 0);
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].contains("1 of 2 values") && lines[0].contains("[1]"),
            "{lines:?}"
        );
        let lines = compare("p", &[1.0, 2.0], &[1.0, 2.0], &[0.1, 0.5], &[0.1, 0.1], 2);
        assert_eq!(lines.len(), 1);
        assert!(lines[0].contains("bound[0][1]"), "{lines:?}");
    }
}
