//! The module cache folder. A `.vmfb` holds native code that kiln runs, so
//! kiln uses a cache folder only if no other user can write it or replace
//! it: the folder must be the user's and writable by them alone, and every
//! folder above it (symlinks resolved, and the symlinks themselves) must be
//! the user's or root's (or unmapped, root as a user namespace shows it) and
//! not writable by others, unless sticky like
//! `/tmp` (where others cannot rename what is not theirs). kiln creates the
//! folder 0700.

use std::fs::{DirBuilder, Metadata};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const STICKY: u32 = 0o1000;
const WRITABLE_BY_OTHERS: u32 = 0o022;

/// The effective user id of this process.
pub fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Creates `dir` (0700, with any missing parents) unless it exists, then
/// checks that only this user can write it. `Ok(Err(reason))` when the
/// folder cannot be created (the cache is then unavailable, not an error);
/// `Err` when it exists but others could write it.
pub fn prepare(dir: &Path) -> Result<std::result::Result<(), String>> {
    if let Err(error) = DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        return Ok(Err(format!("cannot create {}: {error}", dir.display())));
    }
    check(dir, current_uid())?;
    Ok(Ok(()))
}

/// Checks the trust rules of the module docs for `dir`, as user `uid`.
pub fn check(dir: &Path, uid: u32) -> Result<()> {
    let untrusted = |path: &Path, why: String| Error::CacheUntrusted {
        dir: dir.to_path_buf(),
        path: path.to_path_buf(),
        why,
    };
    let metadata = |path: &Path| {
        std::fs::symlink_metadata(path).map_err(|e| untrusted(path, format!("unreadable: {e}")))
    };
    let real = dir
        .canonicalize()
        .map_err(|e| untrusted(dir, format!("unresolvable: {e}")))?;
    let leaf = metadata(&real)?;
    if !leaf.is_dir() {
        return Err(untrusted(&real, "not a folder".into()));
    }
    if leaf.uid() != uid {
        return Err(untrusted(
            &real,
            format!("owned by uid {}, not by this user (uid {uid})", leaf.uid()),
        ));
    }
    if leaf.mode() & WRITABLE_BY_OTHERS != 0 {
        return Err(untrusted(
            &real,
            format!(
                "writable by other users (mode {:o}); `chmod go-w` it",
                leaf.mode() & 0o7777
            ),
        ));
    }
    // Every folder above the real one, and every component of the path as
    // given (a symlink on it could be swapped by whoever owns it).
    let lexical = std::path::absolute(dir).map_err(|e| untrusted(dir, e.to_string()))?;
    for path in ancestors(&real).chain(ancestors(&lexical)) {
        let meta = metadata(&path)?;
        check_component(&path, &meta, uid).map_err(|why| untrusted(&path, why))?;
    }
    Ok(())
}

/// The proper ancestors of `path`, and `path` itself when it is a symlink
/// (the leaf's target is checked as the leaf).
fn ancestors(path: &Path) -> impl Iterator<Item = PathBuf> + '_ {
    let own = std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.file_type().is_symlink())
        .then(|| path.to_path_buf());
    own.into_iter()
        .chain(path.ancestors().skip(1).map(Path::to_path_buf))
}

/// The owner the kernel shows for files whose owner has no id in this user
/// namespace: root's files, seen from a build sandbox (Nix builds run in
/// one, where `/` and `/nix/store` appear owned by it).
fn unmapped_uid() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65534)
}

fn check_component(path: &Path, meta: &Metadata, uid: u32) -> std::result::Result<(), String> {
    if meta.uid() != uid && meta.uid() != 0 && meta.uid() != unmapped_uid() {
        return Err(format!(
            "owned by uid {}, neither this user (uid {uid}) nor root, who could replace what is inside",
            meta.uid()
        ));
    }
    let mode = meta.mode();
    if meta.is_dir() && mode & WRITABLE_BY_OTHERS != 0 && mode & STICKY == 0 {
        return Err(format!(
            "writable by other users and not sticky (mode {:o}), so {} could be replaced",
            mode & 0o7777,
            path.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_new_folder_is_private_and_trusted() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("kiln/modules");
        prepare(&dir).unwrap().unwrap();
        for created in [&dir, &root.path().join("kiln")] {
            let mode = std::fs::metadata(created).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{}", created.display());
        }
        // Sticky and writable by all, like /tmp: others cannot replace it.
        chmod(root.path(), 0o1777);
        prepare(&dir).unwrap().unwrap();
    }

    #[test]
    fn folders_others_can_write_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("shared/modules");
        prepare(&dir).unwrap().unwrap();

        chmod(&dir, 0o777);
        let error = prepare(&dir).unwrap_err().to_string();
        assert!(error.contains("writable by other users"), "{error}");
        assert!(error.contains("chmod go-w"), "{error}");
        chmod(&dir, 0o700);

        // A parent others can write lets them swap the whole folder.
        chmod(&root.path().join("shared"), 0o777);
        let error = prepare(&dir).unwrap_err().to_string();
        assert!(error.contains("not sticky"), "{error}");
        chmod(&root.path().join("shared"), 0o700);

        // Through a symlink: the target's parents are checked too.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(root.path().join("shared"), &link).unwrap();
        prepare(&link.join("modules")).unwrap().unwrap();
        chmod(&root.path().join("shared"), 0o770);
        let error = prepare(&link.join("modules")).unwrap_err().to_string();
        assert!(error.contains("not sticky"), "{error}");
    }

    #[test]
    fn a_folder_of_another_user_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("modules");
        prepare(&dir).unwrap().unwrap();
        // Judged as another user: the folder is not theirs.
        let other = current_uid().wrapping_add(1);
        let error = check(&dir, other).unwrap_err().to_string();
        assert!(error.contains("not by this user"), "{error}");
    }

    #[test]
    fn a_file_in_the_way_makes_the_cache_unavailable_not_an_error() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("modules");
        std::fs::write(&file, b"").unwrap();
        assert!(prepare(&file).unwrap().is_err());
    }
}
