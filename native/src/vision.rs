//! The vision tower and its overlay (export-format §6).

use crate::config::Config;
use crate::manifest::{self, Manifest};
use crate::report::Problems;
use crate::safetensors::{Dtype, MappedFile};
use crate::shapes;

pub fn check(
    cfg: &Config,
    manifest: &Manifest,
    vision: Option<&MappedFile>,
    problems: &mut Problems,
) {
    let expected = shapes::vision(cfg);
    if let Some(vision) = vision {
        shapes::check_file(
            manifest::VISION_FILE,
            &vision.header,
            &expected,
            Dtype::BF16,
            problems,
        );
    }
    if manifest.vision.tensors != expected.len() {
        problems.push(format!(
            "{}: vision.tensors is {}, config.json gives {}",
            manifest::FILE_NAME,
            manifest.vision.tensors,
            expected.len()
        ));
    }
    if let Err(e) = check_trained_blocks(&manifest.vision.trained_blocks, cfg.vision.depth as u64) {
        problems.push(format!(
            "{}: vision.trained_blocks: {e}",
            manifest::FILE_NAME
        ));
    }
}

/// The trained blocks are the last N for some N >= 0: `[depth - N, ..., depth - 1]`.
pub fn check_trained_blocks(blocks: &[u64], depth: u64) -> Result<(), String> {
    let n = blocks.len() as u64;
    let expected: Vec<u64> = (depth.saturating_sub(n)..depth).collect();
    if blocks == expected.as_slice() {
        Ok(())
    } else {
        Err(format!(
            "expected the last {n} of {depth} blocks {expected:?}, found {blocks:?}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trained_blocks_are_the_last_n() {
        assert!(check_trained_blocks(&[], 24).is_ok());
        assert!(check_trained_blocks(&[20, 21, 22, 23], 24).is_ok());
        assert!(check_trained_blocks(&[0, 1, 2], 3).is_ok());
        for bad in [
            &[21, 22, 23, 24][..],
            &[20, 22, 23],
            &[23, 22],
            &[0, 1, 2, 3],
            &[19, 20, 21, 22],
        ] {
            assert!(
                check_trained_blocks(bad, if bad == [0, 1, 2, 3] { 3 } else { 24 }).is_err(),
                "{bad:?}"
            );
        }
    }
}
