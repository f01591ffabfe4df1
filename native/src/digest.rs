//! File size and SHA-256, streamed so a multi-gigabyte shard never sits in memory.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

/// Size in bytes and lowercase hex SHA-256 of a file.
pub fn size_and_sha256(path: &Path) -> Result<(u64, String), String> {
    let mut file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buffer).map_err(|e| format!("cannot read: {e}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        size += n as u64;
    }
    Ok((size, hex(&hasher.finalize())))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digest() {
        // FIPS 180-2 test vector: SHA-256("abc").
        let path = std::env::temp_dir().join(format!("vnc-digest-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();
        let (size, sha) = size_and_sha256(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(size, 3);
        assert_eq!(sha, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
