//! The reference files of nix/pins.json (`reference_files`): files others
//! released — vocabularies with Hugging Face's token ids, chat templates —
//! that tests/released_files.rs holds kiln to. Each archive is fetched and
//! checked against its sha256, and only its listed members are unpacked,
//! each checked against its own sha256, into one folder of the cache.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use sha2::{Digest, Sha256};

use crate::cache::{Cache, content_key};
use crate::fetch::fetch;
use crate::pins::{Pins, ReferenceArchive};

/// The folder the reference files of the current pins unpack to (it may
/// not exist yet): named by what is in it.
pub fn folder(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    let archives: BTreeMap<&str, (String, BTreeMap<String, String>)> = pins
        .reference_archives()?
        .into_iter()
        .map(|(name, a)| (name, (a.download.sha256, a.members)))
        .collect();
    let key = content_key(&serde_json::json!(archives));
    Ok(cache.path("reference-files").join(&key[..16]))
}

/// Fetches and unpacks the reference files if needed; returns their folder.
pub fn provide(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    cache.publish(&folder(cache, pins)?, |staging| {
        for (name, archive) in pins.reference_archives()? {
            let path = fetch(cache, &archive.download)?;
            eprintln!(
                "unpacking {} file(s) of {name}: {}",
                archive.members.len(),
                archive.description
            );
            unpack_members(&path, &archive, staging)?;
        }
        Ok(())
    })
}

/// Writes each member of `archive` (a gzip-compressed tarball at `path`)
/// into `dest` under its file name, after checking its sha256; fails
/// naming a member that is missing, differs or shares a name with another.
fn unpack_members(path: &Path, archive: &ReferenceArchive, dest: &Path) -> Result<()> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let mut left: BTreeMap<&str, &str> = archive
        .members
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
        let actual = hex::encode(Sha256::digest(&bytes));
        if actual != expected {
            return Err(anyhow!(
                "{member} of {} has sha256 {actual}, not the pinned {expected}",
                archive.download.name
            ));
        }
        let name = Path::new(&member)
            .file_name()
            .ok_or_else(|| anyhow!("{member} names no file"))?;
        let to = dest.join(name);
        if to.exists() {
            return Err(anyhow!(
                "two reference files are named {}",
                name.to_string_lossy()
            ));
        }
        std::fs::write(&to, &bytes).with_context(|| format!("cannot write {}", to.display()))?;
    }
    match left.keys().next() {
        Some(missing) => Err(anyhow!(
            "{} has no {missing}; fix reference_files in nix/pins.json",
            archive.download.name
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pins::Download;

    /// A tarball of `files` (path, contents) and the archive pin of the
    /// members `wanted`, each pinned to the sha256 of `pinned_contents`.
    fn archive(dir: &Path, files: &[(&str, &[u8])], wanted: &[(&str, &[u8])]) -> ReferenceArchive {
        let path = dir.join("a.tar.gz");
        let gz = flate2::write::GzEncoder::new(File::create(&path).unwrap(), Default::default());
        let mut tar = tar::Builder::new(gz);
        for (name, contents) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(contents.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, name, *contents).unwrap();
        }
        tar.into_inner().unwrap().finish().unwrap();
        ReferenceArchive {
            download: Download {
                name: "a.tar.gz".into(),
                url: String::new(),
                sha256: String::new(),
            },
            description: String::new(),
            members: wanted
                .iter()
                .map(|(name, contents)| (name.to_string(), hex::encode(Sha256::digest(contents))))
                .collect(),
        }
    }

    #[test]
    fn only_the_pinned_members_are_unpacked_each_checked() {
        let dir = tempfile::tempdir().unwrap();
        let files: [(&str, &[u8]); 3] = [
            ("pkg/models/a.gguf", b"vocab"),
            ("pkg/models/templates/b.jinja", b"{{ x }}"),
            ("pkg/setup.py", b"ignored"),
        ];
        let wanted = &files[..2];
        let pin = archive(dir.path(), &files, wanted);
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        unpack_members(&dir.path().join("a.tar.gz"), &pin, &out).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["a.gguf", "b.jinja"]);
        assert_eq!(std::fs::read(out.join("b.jinja")).unwrap(), b"{{ x }}");

        // A member whose bytes are not the pinned ones, and a missing one.
        let changed = archive(dir.path(), &files, &[("pkg/setup.py", b"other")]);
        let out = tempfile::tempdir().unwrap();
        let error = unpack_members(&dir.path().join("a.tar.gz"), &changed, out.path());
        let error = error.unwrap_err().to_string();
        assert!(
            error.contains("pkg/setup.py of a.tar.gz has sha256"),
            "{error}"
        );
        let missing = archive(dir.path(), &files, &[("pkg/none", b"")]);
        let error = unpack_members(&dir.path().join("a.tar.gz"), &missing, out.path());
        assert!(error.unwrap_err().to_string().contains("has no pkg/none"));
    }
}
