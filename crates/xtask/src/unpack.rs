//! Unpacking of the pinned archives: the IREE source tarball and wheels.

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result};

/// Unpacks a gzip-compressed tarball (a `.crate`) into `dest`.
pub fn tar_gz(archive: &Path, dest: &Path) -> Result<()> {
    let file = File::open(archive)?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
    tar.set_preserve_permissions(true);
    tar.unpack(dest)
        .with_context(|| format!("cannot unpack {}", archive.display()))
}

/// Unpacks a wheel (a zip) into `dest`, keeping executable bits.
pub fn wheel(archive: &Path, dest: &Path) -> Result<()> {
    let file = File::open(archive)?;
    let mut zip = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a zip archive", archive.display()))?;
    zip.extract(dest)
        .with_context(|| format!("cannot unpack {}", archive.display()))
}
