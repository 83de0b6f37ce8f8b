//! kiln's patches to the IREE runtime source (nix/iree-patches/*.patch):
//! each applied in name order with `patch -p1` in the source root, exactly as
//! the Nix derivation's patch phase applies them. The pinned hash covers the
//! unpatched tarball; the patched tree is a cache entry of its own, keyed by
//! that hash and the patches' text.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};
use serde_json::json;

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Pins, repo_root};
use build_support::digest::content_key;
use build_support::unpack;

/// The folder the patches live in.
fn patch_dir() -> PathBuf {
    repo_root().join("nix").join("iree-patches")
}

/// Every patch as (file name, text), in the order they apply.
pub fn list() -> Result<Vec<(String, String)>> {
    let dir = patch_dir();
    let mut patches = Vec::new();
    for entry in
        std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))?
    {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".patch") {
            let text = std::fs::read_to_string(dir.join(&name))
                .with_context(|| format!("cannot read nix/iree-patches/{name}"))?;
            patches.push((name, text));
        }
    }
    // By name (names are unique, so the text never decides).
    patches.sort();
    Ok(patches)
}

/// The pinned IREE source with the patches applied: the tarball's `subdir`
/// inside a cache entry of its own.
pub fn patched_source(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    let pin = &pins.iree.source.download;
    let patches = list()?;
    let key = content_key(&json!({ "source": pin.sha256, "patches": patches }));
    let dir = cache
        .path("src")
        .join(format!("{}-patched-{}", &pin.sha256[..16], &key[..16]));
    let dir = cache.publish(&dir, |staging| {
        if !patches.is_empty() {
            crate::tools::require_host_program("patch", "applies nix/iree-patches")?;
        }
        let tarball = fetch(cache, pin)?;
        eprintln!("unpacking {}", pin.name);
        unpack::tar_gz(&tarball, staging)?;
        let root = staging.join(&pins.iree.source.subdir);
        for (name, _) in &patches {
            apply(&root, &patch_dir().join(name))?;
        }
        Ok(())
    })?;
    let source = dir.join(&pins.iree.source.subdir);
    if !source.join("CMakeLists.txt").exists() {
        return Err(anyhow!(
            "{} has no CMakeLists.txt: is `subdir` in nix/pins.json right?",
            source.display()
        ));
    }
    Ok(source)
}

/// Applies one patch in `root`; a patch that does not apply cleanly (fuzz
/// or a rejected hunk) is an error naming it.
fn apply(root: &Path, patch: &Path) -> Result<()> {
    let (status, text) = crate::process::output_text(
        Command::new("patch")
            .args([
                "-p1",
                "--batch",
                "--forward",
                "--fuzz=0",
                "--no-backup-if-mismatch",
            ])
            .arg("--directory")
            .arg(root)
            .arg("--input")
            .arg(patch),
    )
    .with_context(|| format!("GNU patch; {}", crate::tools::install_hint("patch")))?;
    if !status.success() {
        return Err(anyhow!(
            "{} does not apply to the pinned IREE source; refresh it against that source:\n{text}",
            patch.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_are_listed_in_name_order_with_their_text() {
        let patches = list().unwrap();
        assert!(!patches.is_empty(), "nix/iree-patches has no patch");
        let names: Vec<&str> = patches.iter().map(|(n, _)| n.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        for (name, text) in &patches {
            assert!(
                text.contains("\n+++ b/"),
                "{name} is not a -p1 unified diff"
            );
        }
    }

    #[test]
    fn a_patch_that_does_not_apply_is_an_error_naming_it() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("file.c"), "int a;\n").unwrap();
        let patch = root.path().join("bad.patch");
        std::fs::write(
            &patch,
            "--- a/file.c\n+++ b/file.c\n@@ -1 +1 @@\n-int b;\n+int c;\n",
        )
        .unwrap();
        let error = apply(root.path(), &patch).unwrap_err().to_string();
        assert!(error.contains("bad.patch"), "{error}");
        assert!(error.contains("does not apply"), "{error}");
        // Nothing was half-applied.
        assert_eq!(
            std::fs::read_to_string(root.path().join("file.c")).unwrap(),
            "int a;\n"
        );
    }
}
