//! Language files and the index (export-format §4).

use std::collections::BTreeMap;
use std::path::Path;

use crate::json;
use crate::manifest::{self, Manifest};
use crate::report::Problems;
use crate::safetensors::{Dtype, MappedFile, TensorInfo};
use crate::shapes::{compare, report_missing, Table};

/// The language shards, memory-mapped, with the shard that holds each tensor.
pub struct LanguageFiles {
    pub shards: Vec<(String, MappedFile)>,
    pub by_name: BTreeMap<String, usize>,
}

impl LanguageFiles {
    pub fn get(&self, name: &str) -> Option<(&MappedFile, &TensorInfo)> {
        let &shard = self.by_name.get(name)?;
        let file = &self.shards[shard].1;
        Some((file, &file.header.tensors[name]))
    }
}

/// Indexes the opened shards by tensor name; a name in two shards is a problem.
pub fn collect(shards: Vec<(String, MappedFile)>, problems: &mut Problems) -> LanguageFiles {
    let mut by_name = BTreeMap::new();
    for (k, (file, mapped)) in shards.iter().enumerate() {
        for name in mapped.header.tensors.keys() {
            if let Some(first) = by_name.insert(name.clone(), k) {
                problems.push(format!(
                    "{file}: tensor {name} is also in {} (each tensor once)",
                    shards[first].0
                ));
            }
        }
    }
    LanguageFiles { shards, by_name }
}

/// §4: the language tensors against the table, their count, and the index.
pub fn check(
    dir: &Path,
    manifest: &Manifest,
    expected: &Table,
    files: &LanguageFiles,
    problems: &mut Problems,
) {
    for (file, mapped) in &files.shards {
        compare(
            file,
            mapped.header.tensors.iter(),
            expected,
            Dtype::BF16,
            problems,
        );
    }
    // With a shard unreadable (reported already), its tensors would only repeat that problem.
    let complete = files.shards.len() == manifest.language.files.len();
    if complete {
        let place = manifest.language.files.join(", ");
        report_missing(
            &place,
            expected,
            |name| files.by_name.contains_key(name),
            problems,
        );
    }
    if manifest.language.tensors != expected.len() {
        problems.push(format!(
            "{}: language.tensors is {}, config.json gives {}",
            manifest::FILE_NAME,
            manifest.language.tensors,
            expected.len()
        ));
    }
    if let (Some(index), true) = (&manifest.language.index, complete) {
        check_index(&dir.join(index), index, manifest, files, problems);
    }
}

fn check_index(
    path: &Path,
    index: &str,
    manifest: &Manifest,
    files: &LanguageFiles,
    problems: &mut Problems,
) {
    let value = match json::read_strict(path, manifest::MAX_JSON_LEN) {
        Ok(v) => v,
        Err(e) => return problems.push(format!("{index}: {e}")),
    };
    let weight_map = match value.get("weight_map").and_then(|w| w.as_object()) {
        Some(map) if !map.is_empty() => map,
        _ => return problems.push(format!("{index}: weight_map: expected a non-empty object")),
    };
    let mut shards_named = std::collections::BTreeSet::new();
    for (name, shard) in weight_map {
        let Some(shard) = shard.as_str() else {
            problems.push(format!(
                "{index}: weight_map.{name}: expected a shard file name"
            ));
            continue;
        };
        shards_named.insert(shard.to_string());
        let holder = files.by_name.get(name).map(|&k| files.shards[k].0.as_str());
        if holder != Some(shard) {
            let actual = holder.map_or("no language file".to_string(), |h| format!("it is in {h}"));
            problems.push(format!(
                "{index}: weight_map maps {name} to {shard}, but {actual}"
            ));
        }
    }
    let listed: std::collections::BTreeSet<String> =
        manifest.language.files.iter().cloned().collect();
    if shards_named != listed {
        problems.push(format!(
            "{index}: weight_map names the shards {shards_named:?}, expected language.files {listed:?}"
        ));
    }
    for name in files.by_name.keys() {
        if !weight_map.contains_key(name) {
            problems.push(format!(
                "{index}: weight_map misses {name}, which a shard holds"
            ));
        }
    }
}
