//! One export directory, checked in the order of export-format §13: manifest, file set and
//! hashes, config, safetensors files, then each part against its table.

use std::path::Path;

use crate::config::{self, Config};
use crate::files;
use crate::json;
use crate::language::{self, LanguageFiles};
use crate::manifest::{self, LoraMode, Manifest};
use crate::report::Problems;
use crate::safetensors::{first_non_finite, MappedFile};
use crate::{head, lora, shapes, sources, vision};

/// §2: header caps (on N, the JSON header's length).
const MAX_HEADER: u64 = 16 << 20;
const MAX_ADAPTER_HEADER: u64 = 8 << 20;

/// What the numeric probes need from a readable export.
pub struct Export {
    pub manifest_sha256: String,
    pub manifest: Manifest,
    pub config: Config,
    pub language: LanguageFiles,
    pub adapter: Option<MappedFile>,
    pub head: Option<MappedFile>,
}

/// Checks everything; returns the opened export when manifest and config could be read.
pub fn check_export(dir: &Path, problems: &mut Problems) -> Option<Export> {
    let (manifest, manifest_sha256) = read_manifest(dir, problems)?;
    files::check(dir, &manifest, problems);
    let config = read_config(dir, problems)?;

    let shards = manifest
        .language
        .files
        .iter()
        .filter_map(|f| open(dir, f, MAX_HEADER, problems).map(|m| (f.clone(), m)));
    let language = language::collect(shards.collect(), problems);
    let language_table = shapes::language(&config);
    language::check(dir, &manifest, &language_table, &language, problems);

    let adapter = match manifest.lora.mode {
        LoraMode::Separate => open(dir, manifest::ADAPTER_FILE, MAX_ADAPTER_HEADER, problems),
        LoraMode::Merged => None,
    };
    lora::check(&config, &manifest, adapter.as_ref(), problems);

    let vision_file = open(dir, manifest::VISION_FILE, MAX_HEADER, problems);
    vision::check(&config, &manifest, vision_file.as_ref(), problems);

    let head_file = open(dir, manifest::HEAD_FILE, MAX_HEADER, problems);
    head::check(&config, &manifest, head_file.as_ref(), problems);

    if let Some(name) = &manifest.fp32_sources.file {
        if let Some(file) = open(dir, name, MAX_HEADER, problems) {
            sources::check(&manifest, &language_table, &language, &file, problems);
        }
    }
    Some(Export {
        manifest_sha256,
        manifest,
        config,
        language,
        adapter,
        head: head_file,
    })
}

fn read_manifest(dir: &Path, problems: &mut Problems) -> Option<(Manifest, String)> {
    let name = manifest::FILE_NAME;
    let path = dir.join(name);
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(meta) => meta,
        Err(_) => {
            problems.push(format!(
                "{name}: missing (a directory without it is not an export)"
            ));
            return None;
        }
    };
    if !meta.is_file() {
        problems.push(format!(
            "{name}: expected a regular file (not a symlink or directory)"
        ));
        return None;
    }
    if meta.len() > manifest::MAX_JSON_LEN {
        problems.push(format!(
            "{name}: {} bytes, over the 16 MiB limit",
            meta.len()
        ));
        return None;
    }
    let bytes = problems.check(
        name,
        std::fs::read(&path).map_err(|e| format!("cannot read: {e}")),
    )?;
    let sha = files::sha256_hex(&bytes);
    let text = problems.check(
        name,
        String::from_utf8(bytes).map_err(|_| "not UTF-8".to_string()),
    )?;
    let value = problems.check(
        name,
        json::parse_strict(&text).map_err(|e| format!("not valid JSON: {e}")),
    )?;
    match manifest::parse(&value) {
        Ok(m) => Some((m, sha)),
        Err(errors) => {
            for e in errors {
                problems.push(format!("{name}: {e}"));
            }
            None
        }
    }
}

fn read_config(dir: &Path, problems: &mut Problems) -> Option<Config> {
    let path = dir.join("config.json");
    if !is_regular(&path) {
        return None; // The file-set check has reported it.
    }
    let value = problems.check(
        "config.json",
        json::read_strict(&path, manifest::MAX_JSON_LEN),
    )?;
    match config::parse(&value) {
        Ok(cfg) => Some(cfg),
        Err(errors) => {
            for e in errors {
                problems.push(format!("config.json: {e}"));
            }
            None
        }
    }
}

fn is_regular(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// Maps a safetensors file, validates its container, and refuses non-finite values (§2).
/// A missing file has been reported by the file-set check already.
fn open(dir: &Path, name: &str, max_header: u64, problems: &mut Problems) -> Option<MappedFile> {
    let path = dir.join(name);
    if !is_regular(&path) {
        return None;
    }
    let file = problems.check(name, MappedFile::open(&path, max_header))?;
    for (tensor, info) in &file.header.tensors {
        if let Some(i) = first_non_finite(info.dtype, file.bytes(info)) {
            problems.push(format!(
                "{name}: tensor {tensor}: element {i} is not finite (NaN or infinity)"
            ));
        }
    }
    Some(file)
}
