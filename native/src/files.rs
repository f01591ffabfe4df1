//! The export's file set and hashes (export-format §1, §9, §11).

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::manifest::{self, Manifest};
use crate::report::Problems;

/// §9: copied from the base; the first four always, the others when the base has them.
const COPIED_ALWAYS: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "chat_template.jinja",
    "preprocessor_config.json",
];
const COPIED_OPTIONAL: [&str; 7] = [
    "tokenizer_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
];

/// §1/§11: `files` holds exactly the export's files, each present as a regular file with
/// its size and SHA-256, and the directory holds nothing else but the manifest.
pub fn check(dir: &Path, manifest: &Manifest, problems: &mut Problems) {
    let mut required: BTreeSet<String> = manifest.referenced_files().into_iter().collect();
    required.extend(COPIED_ALWAYS.iter().map(|s| s.to_string()));
    for name in &required {
        if !manifest.files.contains_key(name) {
            problems.push(format!(
                "{}: files: no entry for {name}, a file every such export holds",
                manifest::FILE_NAME
            ));
        }
    }
    for name in manifest.files.keys() {
        if !required.contains(name) && !COPIED_OPTIONAL.contains(&name.as_str()) {
            problems.push(format!(
                "{}: files: {name} is not a file of this export (section 1 lists the files)",
                manifest::FILE_NAME
            ));
        }
    }
    for (name, entry) in &manifest.files {
        let path = dir.join(name);
        match std::fs::symlink_metadata(&path) {
            Err(_) => problems.push(format!(
                "{name}: listed in {} but missing",
                manifest::FILE_NAME
            )),
            Ok(meta) if meta.file_type().is_symlink() => {
                problems.push(format!("{name}: is a symlink, expected a regular file"))
            }
            Ok(meta) if !meta.is_file() => problems.push(format!("{name}: not a regular file")),
            Ok(meta) if meta.len() != entry.size => problems.push(format!(
                "{name}: size {} bytes, expected {} (files.{name}.size)",
                meta.len(),
                entry.size
            )),
            Ok(_) => match size_and_sha256(&path) {
                Err(e) => problems.push(format!("{name}: {e}")),
                Ok((_, sha)) if sha != entry.sha256 => problems.push(format!(
                    "{name}: SHA-256 {sha}, expected {} (files.{name}.sha256)",
                    entry.sha256
                )),
                Ok(_) => {}
            },
        }
    }
    match std::fs::read_dir(dir) {
        Err(e) => problems.push(format!("{}: cannot list the directory: {e}", dir.display())),
        Ok(entries) => {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name != manifest::FILE_NAME && !manifest.files.contains_key(&name) {
                    problems.push(format!(
                        "{name}: not listed in {}'s files (no other entry may exist)",
                        manifest::FILE_NAME
                    ));
                }
            }
        }
    }
}

/// Size in bytes and lowercase hex SHA-256 of a file.
pub fn size_and_sha256(path: &Path) -> Result<(u64, String), String> {
    let mut file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file
            .read(&mut buffer)
            .map_err(|e| format!("cannot read: {e}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        size += n as u64;
    }
    Ok((size, hex(&hasher.finalize())))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::tests::separate;

    /// A directory holding every file the test manifest names, hashed into its `files`.
    fn export_dir(tag: &str) -> (std::path::PathBuf, serde_json::Value) {
        let dir = std::env::temp_dir().join(format!("vnc-files-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let mut value = separate();
        let mut names: Vec<String> = value["files"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        names.extend(
            [
                "tokenizer.json",
                "chat_template.jinja",
                "preprocessor_config.json",
            ]
            .map(String::from),
        );
        let mut files = serde_json::Map::new();
        for name in names {
            std::fs::write(dir.join(&name), name.as_bytes()).unwrap();
            let entry =
                serde_json::json!({"sha256": sha256_hex(name.as_bytes()), "size": name.len()});
            files.insert(name, entry);
        }
        value["files"] = serde_json::Value::Object(files);
        std::fs::write(dir.join(manifest::FILE_NAME), b"{}").unwrap();
        (dir, value)
    }

    fn problems_for(tag: &str, edit: impl FnOnce(&Path, &mut serde_json::Value)) -> Vec<String> {
        let (dir, mut value) = export_dir(tag);
        edit(&dir, &mut value);
        let manifest = manifest::parse(&value).unwrap();
        let mut problems = Problems::default();
        check(&dir, &manifest, &mut problems);
        std::fs::remove_dir_all(&dir).unwrap();
        problems.lines().to_vec()
    }

    #[test]
    fn accepts_the_exact_set() {
        assert_eq!(problems_for("ok", |_, _| {}), Vec::<String>::new());
    }

    #[test]
    fn refuses_set_and_content_differences() {
        let lines = problems_for("bad", |dir, value| {
            std::fs::write(dir.join("config.json"), b"changed!!!!").unwrap(); // same size
            std::fs::write(dir.join("tokenizer.json"), b"x").unwrap();
            std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
            std::fs::write(dir.join("stray.bin"), b"").unwrap();
            value["files"]["notes.txt"] = value["files"]["config.json"].clone();
            std::fs::write(dir.join("notes.txt"), b"config.json").unwrap();
        });
        let expect = [
            "config.json: SHA-256 ",
            "tokenizer.json: size 1 bytes, expected 14",
            "chat_template.jinja: listed in valen_export.json but missing",
            "stray.bin: not listed",
            "files: notes.txt is not a file of this export",
        ];
        for want in expect {
            assert!(lines.iter().any(|l| l.contains(want)), "{want}: {lines:?}");
        }
        assert_eq!(lines.len(), expect.len(), "{lines:?}");
    }

    #[test]
    fn known_digest() {
        // FIPS 180-2 test vector: SHA-256("abc").
        let path = std::env::temp_dir().join(format!("vnc-digest-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();
        let (size, sha) = size_and_sha256(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(size, 3);
        assert_eq!(
            sha,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(sha256_hex(b"abc"), sha);
    }
}
