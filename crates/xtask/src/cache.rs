//! The cache folder: downloads, unpacked inputs, IREE prefixes and the
//! compiler, each in a folder named by the content that went into it.
//!
//! A folder's name says what went into it; a digest beside it
//! (`<folder>.tree-sha256`, written before the folder is published) says
//! what came out. An entry is reused only when its tree still hashes to that
//! digest: one edited, truncated or half-deleted since is removed and built
//! again, loudly.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};

use build_support::digest::tree_digest;

pub struct Cache {
    root: PathBuf,
}

impl Cache {
    /// `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
    pub fn open() -> Result<Cache> {
        let root = if let Some(dir) = std::env::var_os("KILN_CACHE_DIR") {
            PathBuf::from(dir)
        } else if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
            PathBuf::from(dir).join("kiln")
        } else if let Some(home) = std::env::var_os("HOME") {
            PathBuf::from(home).join(".cache").join("kiln")
        } else {
            return Err(anyhow!(
                "no cache folder: set KILN_CACHE_DIR (or HOME) to where kiln may keep downloads and builds"
            ));
        };
        std::fs::create_dir_all(&root)
            .with_context(|| format!("cannot create the cache folder {}", root.display()))?;
        Ok(Cache { root })
    }

    /// A cache at `root` (for tests).
    #[cfg(test)]
    pub fn at(root: &Path) -> Cache {
        Cache {
            root: root.to_path_buf(),
        }
    }

    pub fn path(&self, relative: impl AsRef<Path>) -> PathBuf {
        self.root.join(relative)
    }

    /// Returns `dest` if it exists; otherwise lets `fill` populate a fresh
    /// staging folder and renames it to `dest`. A failed or interrupted fill
    /// leaves nothing at `dest`, so a half-made entry is never reused.
    pub fn publish(&self, dest: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
        if self.reusable(dest)? {
            return Ok(dest.to_path_buf());
        }
        let staging_root = self.path("staging");
        std::fs::create_dir_all(&staging_root)?;
        let staging = tempfile::Builder::new()
            .prefix("entry-")
            .tempdir_in(&staging_root)
            .context("cannot create a staging folder in the cache")?;
        fill(staging.path())?;
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let staged = staging.keep();
        // The digest first: a folder at `dest` without one is never reused.
        write_atomically(&digest_path(dest), &tree_digest(&staged)?)?;
        std::fs::rename(&staged, dest)
            .with_context(|| format!("cannot move {} to {}", staged.display(), dest.display()))?;
        Ok(dest.to_path_buf())
    }

    /// Whether `dest` may be reused: it exists and its tree hashes to the
    /// digest recorded when it was published. A damaged entry (no digest,
    /// or another tree) is moved out of the way and removed, with a line
    /// that says so, and `false` comes back: the caller builds it again.
    pub fn reusable(&self, dest: &Path) -> Result<bool> {
        if !dest.exists() {
            return Ok(false);
        }
        let why = match intact(dest) {
            Ok(()) => return Ok(true),
            Err(why) => why,
        };
        eprintln!(
            "cache: {} is damaged ({why:#}): removing it and building it again",
            dest.display()
        );
        let staging_root = self.path("staging");
        std::fs::create_dir_all(&staging_root)?;
        let aside = tempfile::Builder::new()
            .prefix("damaged-")
            .tempdir_in(&staging_root)?
            .keep();
        std::fs::rename(dest, aside.join("entry"))
            .with_context(|| format!("cannot move the damaged {} aside", dest.display()))?;
        std::fs::remove_dir_all(&aside)
            .with_context(|| format!("cannot remove {}", aside.display()))?;
        std::fs::remove_file(digest_path(dest)).ok();
        Ok(false)
    }
}

/// Ok when `dest`'s tree hashes to the digest recorded beside it.
pub fn intact(dest: &Path) -> Result<()> {
    let recorded = std::fs::read_to_string(digest_path(dest))
        .with_context(|| format!("no digest {}", digest_path(dest).display()))?;
    let found = tree_digest(dest)?;
    if recorded.trim() != found {
        return Err(anyhow!(
            "its tree hashes to {} where {} was recorded",
            &found[..16],
            &recorded.trim()[..16.min(recorded.trim().len())]
        ));
    }
    Ok(())
}

/// Where the digest of an entry is kept: beside it, so that the entry's
/// own tree is exactly what was published.
fn digest_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".tree-sha256");
    dest.with_file_name(name)
}

/// Writes `text` to `path` whole: a temporary file in the same folder,
/// renamed.
pub fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let parent = path.parent().context("a cache path has a parent")?;
    std::fs::create_dir_all(parent)?;
    let mut file = tempfile::NamedTempFile::new_in(parent)?;
    std::io::Write::write_all(&mut file, text.as_bytes())?;
    file.persist(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Publishes `dest` with one file, counting the fills.
    fn publish_one(cache: &Cache, dest: &Path, fills: &Cell<u32>) -> PathBuf {
        cache
            .publish(dest, |staging| {
                fills.set(fills.get() + 1);
                std::fs::create_dir_all(staging.join("lib"))?;
                std::fs::write(staging.join("lib/libthing.a"), b"archive")?;
                Ok(())
            })
            .unwrap()
    }

    /// An intact entry is reused without filling it again; one edited
    /// since is removed and built again.
    #[test]
    fn an_entry_is_reused_while_intact_and_built_again_when_edited() {
        let root = tempfile::tempdir().unwrap();
        let cache = Cache::at(root.path());
        let dest = cache.path("prefix/cpu-0123");
        let fills = Cell::new(0);
        publish_one(&cache, &dest, &fills);
        publish_one(&cache, &dest, &fills);
        assert_eq!(fills.get(), 1);
        intact(&dest).unwrap();
        std::fs::write(dest.join("lib/libthing.a"), b"truncat").unwrap();
        std::fs::write(dest.join("lib/extra.a"), b"left by hand").unwrap();
        assert!(intact(&dest).is_err());
        assert!(!cache.reusable(&dest).unwrap());
        assert!(!dest.exists(), "the damaged entry is removed");
        publish_one(&cache, &dest, &fills);
        assert_eq!(fills.get(), 2);
        assert_eq!(
            std::fs::read(dest.join("lib/libthing.a")).unwrap(),
            b"archive"
        );
        assert!(!dest.join("lib/extra.a").exists());
        intact(&dest).unwrap();
    }

    #[test]
    fn an_entry_without_a_digest_is_not_trusted() {
        // What an older xtask, or a copy by hand, leaves.
        let root = tempfile::tempdir().unwrap();
        let cache = Cache::at(root.path());
        let dest = cache.path("tools/abc");
        std::fs::create_dir_all(&dest).unwrap();
        std::fs::write(dest.join("cmake"), b"#!/bin/sh\n").unwrap();
        let fills = Cell::new(0);
        publish_one(&cache, &dest, &fills);
        assert_eq!(fills.get(), 1);
        assert!(!dest.join("cmake").exists());
    }
}
