//! Copies of the source tree and of prefixes: the gate mutates one of each,
//! `repro` builds two source trees. Copies are always writable by their owner:
//! their originals may come read-only from the Nix store (0444, 0555), and a
//! Nix build user, unlike root, cannot write through those modes.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};

/// The files of the checkout at `root`, relative to it: what git tracks plus
/// untracked files it does not ignore, or, outside a git checkout (a Nix
/// build's source), every file but build output: `target/`, crane's
/// `.cargo-home/` and Nix's `result*` links. (`.cargo/config.toml` must come
/// along: it chooses the linker.)
pub fn source_files(root: &Path) -> Result<Vec<PathBuf>> {
    if root.join(".git").exists() {
        let listing = crate::process::read_bytes(
            Command::new("git")
                .args("ls-files -z --cached --others --exclude-standard".split(' '))
                .current_dir(root),
        )
        .with_context(|| {
            let hint = "`cargo xtask setup` installs it (Debian/Ubuntu package git)";
            format!(
                "cannot list the files of {} with git ({hint})",
                root.display()
            )
        })?;
        return Ok(listing
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .map(|n| PathBuf::from(String::from_utf8_lossy(n).into_owned()))
            // Deleted in the working tree but still in the index.
            .filter(|p| root.join(p).is_file())
            .collect());
    }
    let mut files = Vec::new();
    let walk = walkdir::WalkDir::new(root).into_iter().filter_entry(|e| {
        let name = e.file_name().to_string_lossy();
        e.depth() != 1
            || !(name == "target"
                || name == ".git"
                || name == ".cargo-home"
                || name.starts_with("result"))
    });
    for entry in walk {
        let entry = entry?;
        if entry.file_type().is_file() {
            files.push(entry.path().strip_prefix(root)?.to_path_buf());
        }
    }
    Ok(files)
}

/// Replaces `dest` with a copy of the checkout at `root`.
pub fn copy_checkout(root: &Path, dest: &Path) -> Result<()> {
    let files = source_files(root)?;
    if dest.exists() {
        std::fs::remove_dir_all(dest)?;
    }
    for relative in files {
        let to = dest.join(&relative);
        std::fs::create_dir_all(to.parent().expect("a file has a parent"))?;
        copy_file_writable(&root.join(&relative), &to)?;
    }
    Ok(())
}

/// Copies the folder `from` to `to`, recursively, every copy writable.
pub fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    if !from.is_dir() {
        return Err(anyhow!("{} is not a folder", from.display()));
    }
    for entry in walkdir::WalkDir::new(from) {
        let entry = entry?;
        let target = to.join(entry.path().strip_prefix(from)?);
        if entry.file_type().is_dir() {
            std::fs::create_dir_all(&target)?;
        } else {
            copy_file_writable(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// `std::fs::copy`, which keeps the original's mode, plus the owner's write bit.
fn copy_file_writable(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    let mut permissions = std::fs::metadata(to)?.permissions();
    permissions.set_mode(permissions.mode() | 0o200);
    std::fs::set_permissions(to, permissions)
        .with_context(|| format!("cannot make {} writable", to.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_git_build_output_is_left_out_and_cargo_config_kept() {
        let dir = tempfile::tempdir().unwrap();
        for file in [
            ".cargo/config.toml",
            "src/main.rs",
            "target/release/kiln",
            ".cargo-home/config.toml",
            "result/bin/kiln",
            "crates/a/target/kept.rs",
        ] {
            let path = dir.path().join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, "x").unwrap();
        }
        let mut files = source_files(dir.path()).unwrap();
        files.sort();
        let expected: Vec<PathBuf> = [
            ".cargo/config.toml",
            "crates/a/target/kept.rs",
            "src/main.rs",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(files, expected);
    }
}
