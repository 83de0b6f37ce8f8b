//! Pinned real models: the `models` section of `nix/pins.json` (compiled in,
//! the one pin file Nix and xtask read too), where a pulled model lives in
//! the cache, and how `--model` resolves a name.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};

const PINS_JSON: &str = include_str!("../../../nix/pins.json");

/// A model pinned by the archive that carries it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct PinnedModel {
    #[serde(skip)]
    pub id: String,
    pub description: String,
    /// The archive's file name.
    pub name: String,
    pub url: String,
    pub sha256: String,
    /// The GGUF file's path inside the archive.
    pub member: String,
    pub member_size: u64,
    pub member_sha256: String,
}

/// Every pinned model, in name order.
pub fn models() -> Vec<PinnedModel> {
    #[derive(Deserialize)]
    struct Pins {
        models: std::collections::BTreeMap<String, serde_json::Value>,
    }
    let pins: Pins = serde_json::from_str(PINS_JSON).expect("nix/pins.json is checked by tests");
    pins.models
        .into_iter()
        .filter(|(id, _)| !id.starts_with('_'))
        .map(|(id, value)| PinnedModel {
            id,
            ..serde_json::from_value(value).expect("nix/pins.json is checked by tests")
        })
        .collect()
}

pub fn find(id: &str) -> Option<PinnedModel> {
    models().into_iter().find(|m| m.id == id)
}

/// `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`
/// (the root `cargo xtask` and the module cache use).
pub fn cache_root() -> Result<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("KILN_CACHE_DIR") {
        Ok(PathBuf::from(dir))
    } else if let Some(dir) = var("XDG_CACHE_HOME") {
        Ok(PathBuf::from(dir).join("kiln"))
    } else if let Some(home) = var("HOME") {
        Ok(PathBuf::from(home).join(".cache/kiln"))
    } else {
        Err(Error::Invalid(
            "no cache folder: set KILN_CACHE_DIR (or HOME) to where kiln may keep models".into(),
        ))
    }
}

/// Where pulled models live: `<cache>/models`.
pub fn models_dir() -> Result<PathBuf> {
    Ok(cache_root()?.join("models"))
}

impl PinnedModel {
    /// The pulled file: `<cache>/models/<id>.gguf`. It exists only once a
    /// pull has verified and extracted it completely.
    pub fn path(&self) -> Result<PathBuf> {
        Ok(models_dir()?.join(format!("{}.gguf", self.id)))
    }

    /// The pulled file, checked against the pin, or an error that says how
    /// to pull (or repair) it.
    pub fn pulled(&self) -> Result<PathBuf> {
        let path = self.path()?;
        if !path.is_file() {
            return Err(Error::Invalid(format!(
                "model {} is not pulled yet (no {}); run `kiln pull {}`",
                self.id,
                path.display(),
                self.id
            )));
        }
        match self.check(Rehash::IfChanged)? {
            Pulled::Intact => Ok(path),
            Pulled::Damaged(why) => Err(Error::Invalid(format!(
                "model {} at {} is damaged: {why}; run `kiln pull {}` to replace it",
                self.id,
                path.display(),
                self.id
            ))),
            Pulled::Missing => unreachable!("checked above"),
        }
    }

    /// The stamp beside a pulled file: the sha256, size and modification
    /// time it had when it was last hashed.
    fn stamp_path(&self) -> Result<PathBuf> {
        Ok(models_dir()?.join(format!("{}.gguf.sha256", self.id)))
    }

    /// Whether the pulled file is the pinned one. Cheap when a stamp says
    /// the file was hashed and has not changed since (size and modification
    /// time); otherwise (no stamp, a changed file, or `Rehash::Always`) the
    /// file is hashed again and, when it matches, the stamp rewritten.
    pub fn check(&self, rehash: Rehash) -> Result<Pulled> {
        let path = self.path()?;
        let meta = match std::fs::metadata(&path) {
            Ok(meta) if meta.is_file() => meta,
            _ => return Ok(Pulled::Missing),
        };
        if meta.len() != self.member_size {
            return Ok(Pulled::Damaged(format!(
                "it is {} bytes, the pin says {}",
                meta.len(),
                self.member_size
            )));
        }
        let identity = format!(
            "{} {} {:?}",
            self.member_sha256,
            meta.len(),
            meta.modified().ok()
        );
        let stamp = self.stamp_path()?;
        if rehash == Rehash::IfChanged
            && std::fs::read_to_string(&stamp).is_ok_and(|held| held == identity)
        {
            return Ok(Pulled::Intact);
        }
        let actual = sha256_of(&path)?;
        if actual != self.member_sha256 {
            let _ = std::fs::remove_file(&stamp);
            return Ok(Pulled::Damaged(format!(
                "its sha256 is {actual}, the pin says {}",
                self.member_sha256
            )));
        }
        // A stamp that cannot be written only costs a hash next time.
        let _ = write_atomically(&stamp, identity.as_bytes());
        Ok(Pulled::Intact)
    }
}

/// When [`PinnedModel::check`] hashes the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rehash {
    /// Only when no stamp vouches for the file as it is.
    IfChanged,
    /// Always (`kiln pull --verify`).
    Always,
}

/// What [`PinnedModel::check`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pulled {
    Missing,
    Intact,
    /// Present but not the pinned file, and why.
    Damaged(String),
}

fn sha256_of(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let io = |e: std::io::Error| Error::Invalid(format!("cannot read {}: {e}", path.display()));
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buffer).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Writes `bytes` to a new file beside `path`, then renames it over `path`.
/// The new file is created exclusively: whatever is already at its name (a
/// leftover, or a link planted there) is removed, never written through.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    match std::fs::remove_file(&partial) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .and_then(|mut file| file.write_all(bytes))
        .and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

/// What `--model` names: an existing file or folder, else a pinned model
/// that has been pulled.
pub fn resolve(spec: &Path) -> Result<PathBuf> {
    if spec.exists() {
        return Ok(spec.to_path_buf());
    }
    if let Some(model) = spec.to_str().and_then(find) {
        return model.pulled();
    }
    let names: Vec<String> = models().into_iter().map(|m| m.id).collect();
    Err(Error::Invalid(format!(
        "model {} does not exist: no such file or folder, and no pinned model has that name \
         (pinned: {}; see `kiln list`)",
        spec.display(),
        names.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link planted where the stamp's new copy is written is replaced,
    /// not followed: its target keeps its bytes. Before, `fs::write`
    /// truncated and overwrote the target.
    #[test]
    fn a_planted_link_is_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let stamp = dir.path().join("model.gguf.sha256");
        let partial = stamp.with_extension(format!("partial-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &partial).unwrap();
        write_atomically(&stamp, b"stamp").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(&stamp).unwrap(), "stamp");
        assert!(!partial.exists() && std::fs::symlink_metadata(&partial).is_err());
    }

    #[test]
    fn the_pin_file_lists_smollm2() {
        let model = find("smollm2-135m-instruct").expect("pinned");
        assert_eq!(model.sha256.len(), 64);
        assert!(model.url.ends_with(&model.name), "{}", model.url);
        assert!(model.member.ends_with(".gguf"));
        assert!(models().iter().all(|m| !m.id.starts_with('_')));
    }

    #[test]
    fn unknown_names_are_explained() {
        let error = resolve(Path::new("no-such-model")).unwrap_err().to_string();
        assert!(error.contains("smollm2-135m-instruct"), "{error}");
        assert!(error.contains("kiln list"), "{error}");
    }
}
