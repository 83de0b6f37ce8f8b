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

/// Unpacks only `members` of a wheel into `dest`, at their paths inside it,
/// keeping their modes; fails naming a member the wheel lacks.
pub fn wheel_members(archive: &Path, dest: &Path, members: &[String]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let file = File::open(archive)?;
    let mut zip = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a zip archive", archive.display()))?;
    for member in members {
        let mut entry = zip.by_name(member).with_context(|| {
            format!(
                "{} has no {member}; fix the list in nix/pins.json",
                archive.display()
            )
        })?;
        let to = dest.join(member);
        std::fs::create_dir_all(to.parent().expect("a member has a folder"))?;
        let mut out = File::create(&to)?;
        std::io::copy(&mut entry, &mut out)
            .with_context(|| format!("cannot unpack {member} from {}", archive.display()))?;
        if let Some(mode) = entry.unix_mode() {
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode & 0o7777))?;
        }
    }
    Ok(())
}
