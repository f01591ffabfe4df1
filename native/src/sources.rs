//! FP32 originals of the base tensors rounded to BF16 (export-format §8).

use crate::language::LanguageFiles;
use crate::manifest::{self, Manifest};
use crate::report::Problems;
use crate::safetensors::{Dtype, MappedFile};
use crate::shapes::Table;

/// Round-to-nearest-even of a finite float32 bit pattern to BF16 (§4's formula).
pub fn bf16_round(bits: u32) -> u16 {
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

pub fn check(
    manifest: &Manifest,
    language: &Table,
    files: &LanguageFiles,
    sources: &MappedFile,
    problems: &mut Problems,
) {
    let file = manifest::FP32_SOURCES_FILE;
    let names: Vec<&String> = sources.header.tensors.keys().collect();
    let listed: Vec<&String> = manifest.fp32_sources.tensors.iter().collect();
    if names != listed {
        problems.push(format!(
            "{file}: holds {names:?}, but fp32_sources.tensors lists {listed:?}"
        ));
    }
    for (name, info) in &sources.header.tensors {
        if info.dtype != Dtype::F32 {
            problems.push(format!(
                "{file}: tensor {name}: dtype {}, expected F32",
                info.dtype
            ));
            continue;
        }
        if language.get(name) != Some(&info.shape) {
            problems.push(format!(
                "{file}: tensor {name}: expected a language tensor of shape {:?}, config.json gives {:?}",
                info.shape,
                language.get(name)
            ));
            continue;
        }
        let Some((mapped, bf16)) = files.get(name) else {
            continue;
        };
        if bf16.dtype != Dtype::BF16 || bf16.shape != info.shape {
            continue; // Reported by the language check.
        }
        let originals = sources
            .bytes(info)
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let rounded = mapped
            .bytes(bf16)
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]));
        if let Some(i) = originals.zip(rounded).position(|(f, h)| bf16_round(f) != h) {
            problems.push(format!(
                "{file}: tensor {name}: element {i} does not round (nearest-even) to the BF16 value in the language files"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn rounds_to_nearest_even_like_half() {
        // 1 + 2^-8 and 1 + 3·2^-8 are ties at BF16 precision (7 mantissa bits).
        let tie_down = 1.0 + 2f32.powi(-8);
        let tie_up = 1.0 + 3.0 * 2f32.powi(-8);
        let samples = [
            1.0f32, -2.5, tie_down, tie_up, 3.0e-39, 1.2345e30, -0.0, 65504.0, 0.1,
        ];
        for x in samples {
            assert_eq!(bf16_round(x.to_bits()), bf16::from_f32(x).to_bits(), "{x}");
        }
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: the even mantissa (1.0) wins.
        assert_eq!(bf16_round(tie_down.to_bits()), 0x3f80);
        // 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: the even one is 1 + 2^-6.
        assert_eq!(bf16_round(tie_up.to_bits()), 0x3f82);
    }
}
