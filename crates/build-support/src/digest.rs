//! Every sha256 xtask takes: of bytes, of a file, of a folder's tree, of a
//! JSON value (a cache key). One place, so that the cache, the downloads and
//! the steps' keys cannot hash the same thing two ways.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use anyhow::{Context, Result};
pub use sha2::{Digest, Sha256};

/// The finished hash as lowercase hex.
pub fn hex(hasher: Sha256) -> String {
    hex::encode(hasher.finalize())
}

pub fn sha256_hex(bytes: impl AsRef<[u8]>) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Hex sha256 of a file's bytes.
pub fn sha256_file(path: &Path) -> Result<String> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut reader = BufReader::new(file);
    let mut hasher = Sha256::new();
    std::io::copy(&mut reader, &mut hasher)?;
    Ok(hex(hasher))
}

/// sha256 over a folder: every entry's path relative to it, its kind, and a
/// file's content or a link's target, in path order. Permission bits are
/// left out (tools set executable bits on unpacked wheels after publishing).
pub fn tree_digest(dir: &Path) -> Result<String> {
    let mut hash = Sha256::new();
    for entry in walkdir::WalkDir::new(dir).sort_by_file_name() {
        let entry = entry.with_context(|| format!("cannot walk {}", dir.display()))?;
        let relative = entry.path().strip_prefix(dir).unwrap_or(entry.path());
        let kind = entry.file_type();
        if kind.is_symlink() {
            let target = std::fs::read_link(entry.path())?;
            hash.update(format!(
                "link {} {}\n",
                relative.display(),
                target.display()
            ));
        } else if kind.is_dir() {
            hash.update(format!("dir {}\n", relative.display()));
        } else {
            let file = sha256_file(entry.path())?;
            hash.update(format!("file {} {file}\n", relative.display()));
        }
    }
    Ok(hex(hash))
}

/// sha256 of a JSON value in canonical form (serde_json sorts object keys).
pub fn content_key(inputs: &serde_json::Value) -> String {
    sha256_hex(inputs.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_covers_names_contents_and_links_but_not_modes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("a"), b"one").unwrap();
        std::os::unix::fs::symlink("a", d.join("link")).unwrap();
        let first = tree_digest(d).unwrap();
        std::fs::set_permissions(d.join("a"), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(tree_digest(d).unwrap(), first, "modes are left out");
        std::fs::write(d.join("a"), b"two").unwrap();
        let content = tree_digest(d).unwrap();
        assert_ne!(content, first);
        std::fs::remove_file(d.join("link")).unwrap();
        std::os::unix::fs::symlink("b", d.join("link")).unwrap();
        let link = tree_digest(d).unwrap();
        assert_ne!(link, content);
        std::fs::rename(d.join("a"), d.join("c")).unwrap();
        assert_ne!(tree_digest(d).unwrap(), link);
    }
}
