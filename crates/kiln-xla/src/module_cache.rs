//! The prepared-module cache: compiled `.vmfb` files keyed by everything that
//! determines them (MLIR text, compile flags, the CPU they target, compiler
//! identity, bucket).
//!
//! An entry is `KILNVMFB`, the 64-hex-digit key, the sha256 of the module, and
//! the module. Entries are written to a temporary file and renamed, so a
//! half-written one is never visible; on read, an entry whose key or digest
//! does not match is ignored and rebuilt. The digest only detects damage: what
//! makes an entry trustworthy is the folder ([`crate::cache_dir`]) and that
//! the entry is this user's own regular file.
//!
//! The cache is an optimisation: when an entry cannot be stored, the compiled
//! module is still used, with a warning.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::cache_dir;
use crate::error::{Error, Result};

/// The largest entry kiln reads; modules take their weights as arguments,
/// so real ones are a few MB.
pub const ENTRY_LIMIT: u64 = 1 << 30;

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
    /// A cache folder others could write is an error; one that cannot be
    /// created, or an entry that cannot be stored, is a warning.
    pub fn get_or_compile(
        &self,
        key: &str,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, Origin)> {
        let usable = match cache_dir::prepare(&self.dir)? {
            Ok(()) => true,
            Err(reason) => {
                warn(&format!("the module cache is unavailable: {reason}"));
                false
            }
        };
        let mut origin = Origin::Compiled;
        if usable {
            match self.read_entry(key) {
                Ok(Some(module)) => return Ok((module, Origin::Cached)),
                Ok(None) => {}
                Err(_) => origin = Origin::Rebuilt,
            }
        }
        let module = compile()?;
        if usable && let Err(error) = self.store(key, &module) {
            warn(&format!(
                "could not store the compiled module in the cache ({error}); \
                 it will be compiled again next time"
            ));
        }
        Ok((module, origin))
    }

    /// The module of `key`'s entry: `None` if there is no entry, an error if
    /// there is one kiln will not use (damaged, another key's, not a
    /// regular file of this user, too large).
    fn read_entry(&self, key: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        let path = self.path(key);
        let (file, size) = match kiln_core::files::open_regular(&path) {
            Ok(opened) => opened,
            Err(kiln_core::Error::Io { error, .. })
                if error.kind() == std::io::ErrorKind::NotFound =>
            {
                return Ok(None);
            }
            Err(error) => return Err(error.to_string()),
        };
        let owner = file.metadata().map_err(|e| e.to_string())?.uid();
        if owner != cache_dir::current_uid() {
            return Err(format!("{} is owned by uid {owner}", path.display()));
        }
        if size > ENTRY_LIMIT {
            return Err(format!("{} is {size} bytes", path.display()));
        }
        let mut entry = Vec::with_capacity(size as usize);
        file.take(ENTRY_LIMIT + 1)
            .read_to_end(&mut entry)
            .map_err(|e| e.to_string())?;
        verify(&entry, key)
            .map(|module| Some(module.to_vec()))
            .ok_or_else(|| format!("{} does not verify", path.display()))
    }

    fn store(&self, key: &str, module: &[u8]) -> std::io::Result<()> {
        let mut tmp = tempfile::NamedTempFile::new_in(&self.dir)?;
        // Through the handle the temporary file was created with: reopening
        // it by name could follow a link planted in its place.
        tmp.write_all(MAGIC)?;
        tmp.write_all(key.as_bytes())?;
        tmp.write_all(&Sha256::digest(module))?;
        tmp.write_all(module)?;
        tmp.flush()?;
        tmp.persist(self.path(key)).map_err(|e| e.error)?;
        Ok(())
    }
}

/// A warning on stderr: the cache never fails a run that compiled.
fn warn(message: &str) {
    eprintln!("kiln: warning: {message}");
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
    fn a_failed_store_keeps_the_compiled_module() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::at(&dir.path().join("modules"));
        let key = ModuleCache::key(&["mlir"]);
        // A folder where the entry goes: the rename fails.
        std::fs::create_dir_all(cache.path(&key)).unwrap();
        let (m, o) = cache
            .get_or_compile(&key, || Ok(b"module".to_vec()))
            .unwrap();
        assert_eq!((m.as_slice(), o), (&b"module"[..], Origin::Rebuilt));

        // The cache path is a file: no cache at all, the module still comes.
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let cache = ModuleCache::at(&file);
        let (m, o) = cache
            .get_or_compile(&key, || Ok(b"module".to_vec()))
            .unwrap();
        assert_eq!((m.as_slice(), o), (&b"module"[..], Origin::Compiled));
    }

    #[test]
    fn a_cache_others_can_write_is_refused_before_anything_is_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::at(&dir.path().join("modules"));
        let key = ModuleCache::key(&["mlir"]);
        cache
            .get_or_compile(&key, || Ok(b"module".to_vec()))
            .unwrap();
        std::fs::set_permissions(cache.dir(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = cache
            .get_or_compile(&key, || panic!("must not compile"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("writable by other users"), "{error}");
    }

    #[test]
    fn entries_that_are_not_regular_files_are_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::at(dir.path());
        let key = ModuleCache::key(&["mlir"]);
        std::os::unix::fs::symlink("/dev/zero", cache.path(&key)).unwrap();
        let (m, o) = cache
            .get_or_compile(&key, || Ok(b"module".to_vec()))
            .unwrap();
        assert_eq!((m.as_slice(), o), (&b"module"[..], Origin::Rebuilt));
        let (_, o) = cache
            .get_or_compile(&key, || panic!("must not compile"))
            .unwrap();
        assert_eq!(o, Origin::Cached);
    }

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
