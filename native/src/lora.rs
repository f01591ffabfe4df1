//! The language LoRA (export-format §5): pair count in both modes, the adapter file in
//! separate mode. The scale and rank rules are checked with the manifest.

use crate::config::Config;
use crate::manifest::{self, LoraMode, Manifest};
use crate::report::Problems;
use crate::safetensors::{Dtype, MappedFile};
use crate::shapes;

/// `adapter` is the opened adapter file (separate mode only).
pub fn check(
    cfg: &Config,
    manifest: &Manifest,
    adapter: Option<&MappedFile>,
    problems: &mut Problems,
) {
    let targets = shapes::lora_targets(cfg);
    if manifest.lora.pairs != targets.len() {
        problems.push(format!(
            "{}: lora.pairs is {}, config.json gives {} LoRA targets",
            manifest::FILE_NAME,
            manifest.lora.pairs,
            targets.len()
        ));
    }
    let (LoraMode::Separate, Some(adapter)) = (manifest.lora.mode, adapter) else {
        return;
    };
    let file = manifest::ADAPTER_FILE;
    let expected = shapes::adapter(cfg, manifest.lora.rank);
    let tensors = &adapter.header.tensors;
    shapes::compare(file, tensors.iter(), &expected, Dtype::F32, problems);
    for target in &targets {
        let has_a = tensors.contains_key(&target.lora_a);
        let has_b = tensors.contains_key(&target.lora_b);
        let missing = match (has_a, has_b) {
            (true, true) => continue,
            (false, true) => format!("lora_A {}", target.lora_a),
            (true, false) => format!("lora_B {}", target.lora_b),
            (false, false) => "both A and B".to_string(),
        };
        problems.push(format!(
            "{file}: LoRA pair of {} lacks {missing}",
            target.weight
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{self, tests::tiny};
    use crate::manifest::tests::separate;

    #[test]
    fn counts_pairs_in_both_modes() {
        let cfg = config::parse(&tiny()).unwrap();
        let mut value = separate();
        value["lora"]["pairs"] = serde_json::json!(30);
        let manifest = manifest::parse(&value).unwrap();
        let mut problems = Problems::default();
        check(&cfg, &manifest, None, &mut problems);
        assert_eq!(
            problems.lines(),
            ["valen_export.json: lora.pairs is 30, config.json gives 31 LoRA targets"]
        );
    }
}
