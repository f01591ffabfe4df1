//! The decision head file (export-format §7) and the readout the probes recompute.

use crate::config::Config;
use crate::manifest::{self, Manifest};
use crate::report::Problems;
use crate::safetensors::{Dtype, MappedFile};
use crate::shapes;

pub const CANDIDATE: &str = "candidate.weight";
pub const DECISION: &str = "decision.weight";

pub fn check(
    cfg: &Config,
    manifest: &Manifest,
    head: Option<&MappedFile>,
    problems: &mut Problems,
) {
    let expected = shapes::head(cfg, manifest.head.projection_dim);
    let file = manifest::HEAD_FILE;
    // head.tensors must state exactly the expected shapes and F32.
    let stated: Vec<String> = manifest.head.tensors.keys().cloned().collect();
    let wanted: Vec<String> = expected.keys().cloned().collect();
    if stated != wanted {
        problems.push(format!(
            "{}: head.tensors names {stated:?}, expected {wanted:?}",
            manifest::FILE_NAME
        ));
    }
    for (name, (shape, dtype)) in &manifest.head.tensors {
        let want = expected.get(name);
        let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        if want.is_some_and(|w| w != &shape) || dtype != "F32" {
            problems.push(format!(
                "{}: head.tensors.{name} is {shape:?} {dtype}, expected {:?} F32 (head.projection_dim x text_config.hidden_size)",
                manifest::FILE_NAME,
                want.cloned().unwrap_or_default()
            ));
        }
    }
    if let Some(head) = head {
        shapes::check_file(file, &head.header, &expected, Dtype::F32, problems);
    }
}

/// `logit_k = (W_c·h_k) · (W_d·h_d) · logit_scale`, in f32; `w_c`, `w_d` are row-major [P, H].
pub fn logits(
    w_c: &[f32],
    w_d: &[f32],
    candidates: &[Vec<f32>],
    decision: &[f32],
    logit_scale: f64,
) -> Vec<f32> {
    let d = crate::vectors::matvec(w_d, decision);
    candidates
        .iter()
        .map(|h| {
            let c = crate::vectors::matvec(w_c, h);
            let dot: f32 = c.iter().zip(&d).map(|(a, b)| a * b).sum();
            // One rounding for the scale: the product taken in f64, then rounded to f32.
            (dot as f64 * logit_scale) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_follow_the_formula() {
        // P = 2, H = 2: c = W_c·h, d = W_d·h_d; logit = <c, d> · scale.
        let w_c = [1.0, 2.0, 3.0, 4.0];
        let w_d = [0.5, 0.0, 0.0, 2.0];
        let h = vec![vec![1.0, 1.0], vec![0.0, 1.0]];
        let hd = [2.0, 1.0];
        // d = [1, 2]; c_1 = [3, 7] -> 17; c_2 = [2, 4] -> 10.
        assert_eq!(logits(&w_c, &w_d, &h, &hd, 0.5), vec![8.5, 5.0]);
    }
}
