//! `valen_export.json` (export-format §10-§12): the format marker first, then the fields a
//! reader uses, each with its type and the rules that need nothing but the manifest.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::json::{show, Obj};

pub const FILE_NAME: &str = "valen_export.json";
pub const FORMAT: &str = "valen-native/1";
/// §10: the manifest (and, by assumption, the index) is at most 16 MiB.
pub const MAX_JSON_LEN: u64 = 16 << 20;
pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_LANGUAGE_FILE: &str = "model.safetensors";
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
pub const VISION_FILE: &str = "vision.safetensors";
pub const HEAD_FILE: &str = "valen_head.safetensors";
pub const FP32_SOURCES_FILE: &str = "fp32_sources.safetensors";
const MERGE_RULE: &str = "W' = bf16(float32(W) + (B @ A) * scale)";
const HEAD_FORMULA: &str =
    "logit_k = <W_candidate . float32(h_k), W_decision . float32(h_decision)> * logit_scale";

#[derive(Debug)]
pub struct Language {
    pub files: Vec<String>,
    pub index: Option<String>,
    pub tensors: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraMode {
    Separate,
    Merged,
}

impl LoraMode {
    pub fn name(self) -> &'static str {
        match self {
            LoraMode::Separate => "separate",
            LoraMode::Merged => "merged",
        }
    }
}

#[derive(Debug)]
pub struct Lora {
    pub mode: LoraMode,
    pub rank: usize,
    pub scale: f64,
    pub pairs: usize,
}

#[derive(Debug)]
pub struct Vision {
    pub tensors: usize,
    pub trained_blocks: Vec<u64>,
}

#[derive(Debug)]
pub struct Head {
    /// name -> (shape, dtype) as the manifest states them.
    pub tensors: BTreeMap<String, (Vec<u64>, String)>,
    pub projection_dim: usize,
    pub logit_scale: f64,
}

#[derive(Debug)]
pub struct Fp32Sources {
    pub file: Option<String>,
    pub tensors: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct FileEntry {
    pub sha256: String,
    pub size: u64,
}

#[derive(Debug)]
pub struct Manifest {
    pub language: Language,
    pub lora: Lora,
    pub vision: Vision,
    pub head: Head,
    pub fp32_sources: Fp32Sources,
    pub files: BTreeMap<String, FileEntry>,
}

/// Informational top-level fields: required, type checked, content ignored (§10).
const INFORMATIONAL: [(&str, &str); 8] = [
    ("model_id", "string"),
    ("pins", "object"),
    ("source", "object"),
    ("dtype_decisions", "array"),
    ("dropped", "array"),
    ("prompt", "object"),
    ("exporter", "object"),
    ("producer_runtime", "object"),
];

/// Checks the manifest; every error names its field. A wrong `format` is the only error
/// reported, since nothing else may be read then (§12).
pub fn parse(value: &Value) -> Result<Manifest, Vec<String>> {
    let root = Obj::root(value, "the manifest").map_err(|e| vec![e])?;
    match root.get("format") {
        Ok(Value::String(f)) if f == FORMAT => {}
        Ok(other) => {
            return Err(vec![format!(
                "format: expected exactly {FORMAT:?}, found {}",
                show(other)
            )])
        }
        Err(e) => return Err(vec![e]),
    }
    let mut errors = Vec::new();
    for (key, kind) in INFORMATIONAL {
        let ok = match root.get(key) {
            Ok(v) => match kind {
                "string" => v.is_string(),
                "object" => v.is_object(),
                _ => v.is_array(),
            },
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        if !ok {
            errors.push(format!(
                "{key}: expected {kind}, found {}",
                show(&root.map[key])
            ));
        }
    }
    let language = section(root, "language", parse_language, &mut errors);
    let lora = section(root, "lora", parse_lora, &mut errors);
    let vision = section(root, "vision", parse_vision, &mut errors);
    let head = section(root, "head", parse_head, &mut errors);
    let fp32_sources = section(root, "fp32_sources", parse_fp32_sources, &mut errors);
    let files = match parse_files(root) {
        Ok(files) => Some(files),
        Err(mut e) => {
            errors.append(&mut e);
            None
        }
    };
    match (language, lora, vision, head, fp32_sources, files) {
        (Some(language), Some(lora), Some(vision), Some(head), Some(fp32_sources), Some(files))
            if errors.is_empty() =>
        {
            let manifest = Manifest {
                language,
                lora,
                vision,
                head,
                fp32_sources,
                files,
            };
            let unlisted = manifest
                .referenced_files()
                .into_iter()
                .filter(|f| !manifest.files.contains_key(f));
            let missing: Vec<String> = unlisted
                .map(|f| format!("files: no entry for {f}, which the manifest names"))
                .collect();
            if missing.is_empty() {
                Ok(manifest)
            } else {
                Err(missing)
            }
        }
        _ => Err(errors),
    }
}

fn section<'a, T>(
    root: Obj<'a>,
    key: &'static str,
    parse: fn(Obj<'a>) -> Result<T, String>,
    errors: &mut Vec<String>,
) -> Option<T> {
    match root.obj(key, key).and_then(parse) {
        Ok(v) => Some(v),
        Err(e) => {
            errors.push(e);
            None
        }
    }
}

/// §11: a plain file name (the schema's pattern), never the manifest itself.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        && !matches!(name, "." | ".." | FILE_NAME)
}

/// §4: `model.safetensors` alone without an index, else `model-0000k-of-0000n.safetensors`.
fn check_language_naming(files: &[String], index: Option<&str>) -> Result<(), String> {
    let expected: Vec<String> = match index {
        None => vec![SINGLE_LANGUAGE_FILE.to_string()],
        Some(_) => {
            let n = files.len();
            (1..=n)
                .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
                .collect()
        }
    };
    if files == expected {
        Ok(())
    } else {
        Err(format!(
            "language.files: expected {expected:?} for language.index {index:?}, found {files:?}"
        ))
    }
}

fn parse_language(obj: Obj) -> Result<Language, String> {
    obj.expect_str("prefix", crate::shapes::LANGUAGE_PREFIX)?;
    obj.expect_str("dtype", "BF16")?;
    let files: Vec<String> = obj
        .str_list("files")?
        .into_iter()
        .map(String::from)
        .collect();
    if let Some(bad) = files.iter().find(|f| !is_plain_file_name(f)) {
        return Err(format!("language.files: {bad:?} is not a plain file name"));
    }
    let index = obj.str_or_null("index")?.map(String::from);
    if let Some(name) = &index {
        if name != INDEX_FILE {
            return Err(format!(
                "language.index: expected {INDEX_FILE:?} or null, found {name:?}"
            ));
        }
    }
    check_language_naming(&files, index.as_deref())?;
    let tensors = obj.positive("tensors")?;
    Ok(Language {
        files,
        index,
        tensors,
    })
}

fn parse_lora(obj: Obj) -> Result<Lora, String> {
    let mode = match obj.str("mode")? {
        "separate" => LoraMode::Separate,
        "merged" => LoraMode::Merged,
        other => {
            return Err(format!(
                "lora.mode: expected \"separate\" or \"merged\", found {other:?}"
            ))
        }
    };
    // Fields whose value the mode fixes (schema: if separate ... else ...).
    let adapter_prefix = format!(
        "{}{}",
        crate::shapes::ADAPTER_PREFIX,
        crate::shapes::LANGUAGE_PREFIX
    );
    let fixed: [(&str, Option<&str>, Option<&str>); 4] = [
        ("file", Some(ADAPTER_FILE), None),
        ("dtype", Some("F32"), None),
        ("key_prefix", Some(&adapter_prefix), None),
        ("merge_rule", None, Some(MERGE_RULE)),
    ];
    for (key, separate, merged) in fixed {
        let want = if mode == LoraMode::Separate {
            separate
        } else {
            merged
        };
        let found = obj.str_or_null(key)?;
        if found != want {
            let want = want.map_or("null".to_string(), |w| format!("{w:?}"));
            return Err(format!(
                "lora.{key}: expected {want} in {} mode, found {}",
                mode.name(),
                show(obj.get(key)?)
            ));
        }
    }
    let rank = obj.positive("rank")?;
    if rank > 128 {
        return Err(format!("lora.rank: expected 1..128, found {rank}"));
    }
    let alpha = obj.number("alpha")?;
    if !(alpha.is_finite() && alpha > 0.0) {
        return Err(format!(
            "lora.alpha: expected a finite number > 0, found {alpha}"
        ));
    }
    let scale = obj.number("scale")?;
    // §5: alpha / rank in double precision, compared exactly.
    if !(scale.is_finite() && scale > 0.0) || scale != alpha / rank as f64 {
        return Err(format!(
            "lora.scale: expected lora.alpha / lora.rank = {} in double precision, found {scale}",
            alpha / rank as f64
        ));
    }
    let pairs = obj.positive("pairs")?;
    Ok(Lora {
        mode,
        rank,
        scale,
        pairs,
    })
}

fn parse_vision(obj: Obj) -> Result<Vision, String> {
    obj.expect_str("file", VISION_FILE)?;
    obj.expect_str("prefix", crate::shapes::VISION_PREFIX)?;
    obj.expect_str("dtype", "BF16")?;
    obj.bool("trained_merger")?;
    Ok(Vision {
        tensors: obj.positive("tensors")?,
        trained_blocks: obj.uint_list("trained_blocks")?,
    })
}

fn parse_head(obj: Obj) -> Result<Head, String> {
    obj.expect_str("file", HEAD_FILE)?;
    obj.expect_str("formula", HEAD_FORMULA)?;
    let projection_dim = obj.positive("projection_dim")?;
    let logit_scale = obj.number("logit_scale")?;
    // §7: P^-0.5 within 1e-12, relative.
    if (logit_scale * (projection_dim as f64).sqrt() - 1.0).abs() > 1e-12 {
        return Err(format!(
            "head.logit_scale: expected projection_dim^-0.5 = {}, found {logit_scale}",
            (projection_dim as f64).powf(-0.5)
        ));
    }
    let listed = obj.obj("tensors", "head.tensors")?;
    let mut tensors = BTreeMap::new();
    for (name, value) in listed.map {
        let path = format!("head.tensors.{name}");
        let entry = value.as_object().map(|map| Obj { path: &path, map });
        let entry =
            entry.ok_or_else(|| format!("{path}: expected an object, found {}", show(value)))?;
        let shape = entry.uint_list("shape")?;
        let dtype = entry.str("dtype")?.to_string();
        tensors.insert(name.clone(), (shape, dtype));
    }
    Ok(Head {
        tensors,
        projection_dim,
        logit_scale,
    })
}

fn parse_fp32_sources(obj: Obj) -> Result<Fp32Sources, String> {
    let file = obj.str_or_null("file")?.map(String::from);
    if let Some(name) = &file {
        if name != FP32_SOURCES_FILE {
            return Err(format!(
                "fp32_sources.file: expected {FP32_SOURCES_FILE:?} or null, found {name:?}"
            ));
        }
    }
    let tensors: Vec<String> = obj
        .str_list("tensors")?
        .into_iter()
        .map(String::from)
        .collect();
    if !tensors.windows(2).all(|w| w[0] < w[1]) {
        return Err("fp32_sources.tensors: expected names sorted and unique".into());
    }
    if file.is_none() != tensors.is_empty() {
        return Err(format!(
            "fp32_sources: file is {} but tensors lists {} names (null exactly when empty)",
            file.as_deref().unwrap_or("null"),
            tensors.len()
        ));
    }
    Ok(Fp32Sources { file, tensors })
}

fn parse_files(root: Obj) -> Result<BTreeMap<String, FileEntry>, Vec<String>> {
    let files = root.obj("files", "files").map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let mut entries = BTreeMap::new();
    if files.map.is_empty() {
        errors.push("files: expected at least one entry".to_string());
    }
    for (name, value) in files.map {
        if !is_plain_file_name(name) {
            errors.push(format!(
                "files: key {name:?} is not a plain file name (or is the manifest)"
            ));
            continue;
        }
        let path = format!("files.{name}");
        let Some(map) = value.as_object() else {
            errors.push(format!("{path}: expected an object, found {}", show(value)));
            continue;
        };
        let entry = Obj { path: &path, map };
        match (entry.str("sha256"), entry.uint("size")) {
            (Ok(sha), Ok(size)) if is_sha256_hex(sha) => {
                entries.insert(
                    name.clone(),
                    FileEntry {
                        sha256: sha.to_string(),
                        size,
                    },
                );
            }
            (Ok(sha), Ok(_)) => errors.push(format!(
                "{path}.sha256: expected 64 lowercase hex digits, found {sha:?}"
            )),
            (Err(e), _) | (_, Err(e)) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(entries)
    } else {
        Err(errors)
    }
}

pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl Manifest {
    /// Every file the manifest's sections name (§10: each must be a key of `files`).
    pub fn referenced_files(&self) -> Vec<String> {
        let mut names = self.language.files.clone();
        names.extend(self.language.index.clone());
        if self.lora.mode == LoraMode::Separate {
            names.push(ADAPTER_FILE.into());
        }
        names.push(VISION_FILE.into());
        names.push(HEAD_FILE.into());
        names.extend(self.fp32_sources.file.clone());
        names
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// An edit of a valid document and a fragment of the error it must cause.
    type Case = (fn(&mut Value), &'static str);
    use serde_json::json;

    const SHA: &str = "c5d5dbd4528be9fd64afc2acfe182240b3aa05a8db0173f1d1c0b9ad5285e046";

    pub fn separate() -> Value {
        let file = json!({"sha256": SHA, "size": 1});
        json!({
            "format": "valen-native/1", "model_id": "valen-preview-0923", "pins": {}, "source": {},
            "dtype_decisions": [], "dropped": [], "prompt": {}, "exporter": {}, "producer_runtime": {},
            "language": {"prefix": "model.language_model.", "files": ["model-00001-of-00001.safetensors"],
                "index": "model.safetensors.index.json", "tensors": 55, "dtype": "BF16"},
            "lora": {"mode": "separate", "file": "adapter_model.safetensors", "rank": 32, "alpha": 64,
                "scale": 2.0, "pairs": 31, "dtype": "F32", "key_prefix": "base_model.model.model.language_model.",
                "merge_rule": null},
            "vision": {"file": "vision.safetensors", "prefix": "model.visual.", "tensors": 81,
                "trained_blocks": [2, 3, 4, 5], "trained_merger": true, "dtype": "BF16"},
            "head": {"file": "valen_head.safetensors", "projection_dim": 256, "logit_scale": 0.0625,
                "tensors": {"candidate.weight": {"shape": [256, 64], "dtype": "F32"},
                            "decision.weight": {"shape": [256, 64], "dtype": "F32"}},
                "formula": HEAD_FORMULA},
            "fp32_sources": {"file": "fp32_sources.safetensors", "tensors": ["a", "b"]},
            "files": {"adapter_model.safetensors": file, "model-00001-of-00001.safetensors": file,
                "model.safetensors.index.json": file, "vision.safetensors": file,
                "valen_head.safetensors": file, "fp32_sources.safetensors": file, "config.json": file}
        })
    }

    fn first_error(edit: impl FnOnce(&mut Value)) -> String {
        let mut v = separate();
        edit(&mut v);
        parse(&v).unwrap_err().join(" | ")
    }

    #[test]
    fn parses_a_separate_manifest() {
        let m = parse(&separate()).unwrap();
        assert_eq!(
            (m.lora.mode, m.lora.rank, m.lora.scale, m.lora.pairs),
            (LoraMode::Separate, 32, 2.0, 31)
        );
        assert_eq!(
            m.head.tensors["decision.weight"],
            (vec![256, 64], "F32".to_string())
        );
        assert_eq!(m.files.len(), 7);
    }

    #[test]
    fn refuses_other_formats_before_anything_else() {
        for bad in [json!("valen-native/2"), json!("valen-native/1.1"), json!(1)] {
            let mut v = separate();
            v["format"] = bad;
            v["lora"] = json!(null);
            let errors = parse(&v).unwrap_err();
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(errors[0].starts_with("format: expected exactly \"valen-native/1\""));
        }
        let mut v = separate();
        v.as_object_mut().unwrap().remove("format");
        assert_eq!(parse(&v).unwrap_err(), vec!["format: missing"]);
    }

    #[test]
    fn refuses_bad_fields_naming_them() {
        let cases: Vec<Case> = vec![
            (|v| v["lora"]["scale"] = json!(2.5), "lora.scale"),
            (|v| v["lora"]["rank"] = json!(129), "lora.rank"),
            (|v| v["lora"]["rank"] = json!(0), "lora.rank"),
            (
                |v| v["lora"]["mode"] = json!("merged"),
                "lora.file: expected null in merged mode",
            ),
            (
                |v| v["head"]["logit_scale"] = json!(0.0626),
                "head.logit_scale",
            ),
            (
                |v| v["language"]["files"] = json!(["model-00001-of-00002.safetensors"]),
                "language.files",
            ),
            (|v| v["language"]["index"] = json!(null), "language.files"),
            (
                |v| v["files"]["config.json"]["sha256"] = json!(SHA.to_uppercase()),
                "files.config.json.sha256",
            ),
            (
                |v| v["files"]["../x"] = json!({"sha256": SHA, "size": 1}),
                "not a plain file name",
            ),
            (
                |v| v["files"]["valen_export.json"] = json!({"sha256": SHA, "size": 1}),
                "\"valen_export.json\"",
            ),
            (
                |v| v["fp32_sources"]["tensors"] = json!(["b", "a"]),
                "sorted",
            ),
            (|v| v["model_id"] = json!(3), "model_id: expected string"),
            (
                |v| {
                    v["files"]
                        .as_object_mut()
                        .unwrap()
                        .remove("vision.safetensors");
                },
                "no entry for vision.safetensors",
            ),
        ];
        for (edit, want) in cases {
            let got = first_error(edit);
            assert!(got.contains(want), "{want}: {got}");
        }
    }

    #[test]
    fn file_names_are_plain() {
        assert!(is_plain_file_name("model-00001-of-00002.safetensors"));
        for bad in ["", ".", "..", "a/b", "./a", "valen_export.json", "a b"] {
            assert!(!is_plain_file_name(bad), "{bad}");
        }
    }
}
