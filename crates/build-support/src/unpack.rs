//! Unpacking of the pinned archives: the IREE source tarball and wheels.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::digest::sha256_hex;
use anyhow::{Context, Result, anyhow};

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

/// Writes each of `members` (a path inside the gzip-compressed tarball
/// `archive`, and the sha256 its bytes must have) into `dest` under its file
/// name, after checking its hash; fails naming a member that is missing,
/// differs, or shares a file name with another.
pub fn tar_gz_members_checked(
    archive: &Path,
    members: &BTreeMap<String, String>,
    dest: &Path,
) -> Result<()> {
    let file = File::open(archive).with_context(|| format!("cannot open {}", archive.display()))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let mut left: BTreeMap<&str, &str> = members
        .iter()
        .map(|(member, sha)| (member.as_str(), sha.as_str()))
        .collect();
    for entry in tar.entries()? {
        let mut entry = entry?;
        let member = entry.path()?.to_string_lossy().into_owned();
        let Some(expected) = left.remove(member.as_str()) else {
            continue;
        };
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes)?;
        let actual = sha256_hex(&bytes);
        if actual != expected {
            return Err(anyhow!(
                "{member} of {} has sha256 {actual}, not the pinned {expected}",
                archive.display()
            ));
        }
        let name = Path::new(&member)
            .file_name()
            .ok_or_else(|| anyhow!("{member} names no file"))?;
        let to = dest.join(name);
        if to.exists() {
            return Err(anyhow!("two members are named {}", name.to_string_lossy()));
        }
        std::fs::write(&to, &bytes).with_context(|| format!("cannot write {}", to.display()))?;
    }
    match left.keys().next() {
        Some(missing) => Err(anyhow!(
            "{} has no {missing}; fix the list in nix/pins.json",
            archive.display()
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tarball at `path` of `files` (path, contents), and the pins of
    /// `wanted` (path, the contents whose sha256 is pinned).
    fn tarball(
        path: &Path,
        files: &[(&str, &[u8])],
        wanted: &[(&str, &[u8])],
    ) -> BTreeMap<String, String> {
        let gz = flate2::write::GzEncoder::new(File::create(path).unwrap(), Default::default());
        let mut tar = tar::Builder::new(gz);
        for (name, contents) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(contents.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, name, *contents).unwrap();
        }
        tar.into_inner().unwrap().finish().unwrap();
        wanted
            .iter()
            .map(|(name, contents)| (name.to_string(), sha256_hex(contents)))
            .collect()
    }

    #[test]
    fn only_the_pinned_members_are_unpacked_each_checked() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("a.tar.gz");
        let files: [(&str, &[u8]); 3] = [
            ("pkg/models/a.gguf", b"vocab"),
            ("pkg/models/templates/b.jinja", b"{{ x }}"),
            ("pkg/setup.py", b"ignored"),
        ];
        let pins = tarball(&archive, &files, &files[..2]);
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        tar_gz_members_checked(&archive, &pins, &out).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["a.gguf", "b.jinja"]);
        assert_eq!(std::fs::read(out.join("b.jinja")).unwrap(), b"{{ x }}");

        // A member whose bytes are not the pinned ones, and a missing one.
        let changed = tarball(&archive, &files, &[("pkg/setup.py", b"other")]);
        let out = tempfile::tempdir().unwrap();
        let error = tar_gz_members_checked(&archive, &changed, out.path()).unwrap_err();
        assert!(error.to_string().contains("pkg/setup.py of"), "{error}");
        assert!(error.to_string().contains("has sha256"), "{error}");
        let missing = tarball(&archive, &files, &[("pkg/none", b"")]);
        let error = tar_gz_members_checked(&archive, &missing, out.path()).unwrap_err();
        assert!(error.to_string().contains("has no pkg/none"), "{error}");
    }
}
