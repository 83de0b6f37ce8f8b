//! The cache folder: downloads, unpacked inputs, IREE prefixes and the
//! compiler, each in a folder named by the content that went into it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use sha2::{Digest, Sha256};

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
        if dest.exists() {
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
        std::fs::rename(&staged, dest)
            .with_context(|| format!("cannot move {} to {}", staged.display(), dest.display()))?;
        Ok(dest.to_path_buf())
    }
}

/// sha256 of a JSON value in canonical form (serde_json sorts object keys).
pub fn content_key(inputs: &serde_json::Value) -> String {
    hex::encode(Sha256::digest(inputs.to_string().as_bytes()))
}
