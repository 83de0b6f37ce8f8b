//! The prepared-module cache: compiled `.vmfb` files keyed by everything that
//! determines them (MLIR text, compile flags, compiler identity, bucket).
//!
//! An entry is `KILNVMFB`, the 64-hex-digit key, the sha256 of the module, and
//! the module. Entries are written to a temporary file and renamed, so a
//! half-written one is never visible; on read, an entry whose key or digest
//! does not match is ignored and rebuilt.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"KILNVMFB";
const HEADER: usize = MAGIC.len() + 64 + 32;

pub struct ModuleCache {
    dir: PathBuf,
}

/// How a module was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Cached,
    Compiled,
    /// An entry was there but did not verify; it was rebuilt.
    Rebuilt,
}

impl ModuleCache {
    /// `$KILN_CACHE_DIR/modules`, else `$XDG_CACHE_HOME/kiln/modules`, else
    /// `~/.cache/kiln/modules` (the same root `cargo xtask` uses).
    pub fn default_location() -> Result<ModuleCache> {
        let root = if let Some(dir) = std::env::var_os("KILN_CACHE_DIR") {
            PathBuf::from(dir)
        } else if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
            PathBuf::from(dir).join("kiln")
        } else if let Some(home) = std::env::var_os("HOME") {
            PathBuf::from(home).join(".cache/kiln")
        } else {
            return Err(Error::Cache(
                "no cache folder: set KILN_CACHE_DIR (or HOME)".into(),
            ));
        };
        Ok(ModuleCache::at(&root.join("modules")))
    }

    pub fn at(dir: &Path) -> ModuleCache {
        ModuleCache {
            dir: dir.to_path_buf(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of a module: sha256 over each part, length-prefixed.
    pub fn key(parts: &[&str]) -> String {
        let mut hasher = Sha256::new();
        for part in parts {
            hasher.update((part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
        hex::encode(hasher.finalize())
    }

    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.vmfb"))
    }

    /// The cached module of `key`, or `compile()`'s, stored for next time.
    pub fn get_or_compile(
        &self,
        key: &str,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, Origin)> {
        let path = self.path(key);
        let mut origin = Origin::Compiled;
        if let Ok(bytes) = std::fs::read(&path) {
            match verify(&bytes, key) {
                Some(module) => return Ok((module.to_vec(), Origin::Cached)),
                None => origin = Origin::Rebuilt,
            }
        }
        let module = compile()?;
        self.store(key, &module)?;
        Ok((module, origin))
    }

    fn store(&self, key: &str, module: &[u8]) -> Result<()> {
        let io = |e: std::io::Error| Error::Cache(format!("{}: {e}", self.dir.display()));
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let mut entry = Vec::with_capacity(HEADER + module.len());
        entry.extend_from_slice(MAGIC);
        entry.extend_from_slice(key.as_bytes());
        entry.extend_from_slice(&Sha256::digest(module));
        entry.extend_from_slice(module);
        let tmp = tempfile::NamedTempFile::new_in(&self.dir).map_err(io)?;
        std::fs::write(tmp.path(), &entry).map_err(io)?;
        tmp.persist(self.path(key)).map_err(|e| io(e.error))?;
        Ok(())
    }
}

/// The module inside a cache entry, if the entry is for `key` and intact.
fn verify<'a>(entry: &'a [u8], key: &str) -> Option<&'a [u8]> {
    if entry.len() < HEADER || &entry[..8] != MAGIC || &entry[8..72] != key.as_bytes() {
        return None;
    }
    let module = &entry[HEADER..];
    (Sha256::digest(module).as_slice() == &entry[72..HEADER]).then_some(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_bad_ones_are_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::at(dir.path());
        let a = ModuleCache::key(&["mlir a", "--flag"]);
        let b = ModuleCache::key(&["mlir b", "--flag"]);
        assert_ne!(a, b);
        let (m, o) = cache
            .get_or_compile(&a, || Ok(b"module a".to_vec()))
            .unwrap();
        assert_eq!((m.as_slice(), o), (&b"module a"[..], Origin::Compiled));
        let (m, o) = cache
            .get_or_compile(&a, || panic!("must not compile"))
            .unwrap();
        assert_eq!((m.as_slice(), o), (&b"module a"[..], Origin::Cached));

        // Another key's entry under this key's name is not used.
        std::fs::copy(cache.path(&a), cache.path(&b)).unwrap();
        let (m, o) = cache
            .get_or_compile(&b, || Ok(b"module b".to_vec()))
            .unwrap();
        assert_eq!((m.as_slice(), o), (&b"module b"[..], Origin::Rebuilt));

        // A flipped byte or a truncated entry is detected.
        let mut bytes = std::fs::read(cache.path(&a)).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(cache.path(&a), &bytes).unwrap();
        let (_, o) = cache
            .get_or_compile(&a, || Ok(b"module a".to_vec()))
            .unwrap();
        assert_eq!(o, Origin::Rebuilt);
        std::fs::write(cache.path(&a), &bytes[..20]).unwrap();
        let (_, o) = cache
            .get_or_compile(&a, || Ok(b"module a".to_vec()))
            .unwrap();
        assert_eq!(o, Origin::Rebuilt);
        let (_, o) = cache
            .get_or_compile(&a, || panic!("must not compile"))
            .unwrap();
        assert_eq!(o, Origin::Cached);
    }
}
