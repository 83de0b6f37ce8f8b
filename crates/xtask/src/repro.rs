//! `cargo xtask repro`: builds kiln's release `cuda,xla-iree` binaries twice, from
//! copies of the checkout at two different paths into two different target
//! folders, and compares them byte for byte.

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use object::{Object, ObjectSection};

use crate::pins::repo_root;
use build_support::digest::sha256_file;
use build_support::tree::copy_checkout;

/// The two builds' checkout folder names differ in length too, so a leaked
/// path cannot hide by padding.
const CHECKOUTS: [&str; 2] = ["first", "second-checkout"];

pub fn run(prefix: &Path) -> Result<()> {
    let work = repo_root().join("target").join("repro");
    let mut builds = Vec::new();
    for name in CHECKOUTS {
        let checkout = work.join(name).join("kiln");
        let target = work.join(name).join(format!("{name}-target"));
        copy_checkout(&repo_root(), &checkout)?;
        eprintln!("building the release binaries in {}", checkout.display());
        // kiln's own binaries; xtask embeds its checkout path by design.
        let build = "build --release --locked --features cuda,xla-iree --package kiln --bins";
        crate::process::run(
            crate::process::cargo()
                .args(build.split(' '))
                .current_dir(&checkout)
                .env("CARGO_TARGET_DIR", &target)
                .env("KILN_IREE_PREFIX", prefix),
            &format!("the release build in {}", checkout.display()),
        )?;
        builds.push(target.join("release"));
    }

    let binaries = binaries(&builds[0])?;
    if binaries.is_empty() {
        return Err(anyhow!("no binaries in {}", builds[0].display()));
    }
    let mut differ = 0;
    for name in &binaries {
        let (a, b) = (builds[0].join(name), builds[1].join(name));
        let (ha, hb) = (sha256_file(&a)?, sha256_file(&b)?);
        if ha == hb {
            println!("same     {name}  {ha}");
        } else {
            differ += 1;
            println!(
                "DIFFERS  {name}  {ha} vs {hb}  ({})",
                first_difference(&a, &b)?
            );
        }
    }
    println!(
        "repro: {} binaries, {} identical, {differ} differ",
        binaries.len(),
        binaries.len() - differ
    );
    std::fs::remove_dir_all(&work).ok();
    if differ > 0 {
        return Err(anyhow!("{differ} release binaries are not reproducible"));
    }
    Ok(())
}

/// The executables cargo put in `dir` (files with no extension and an
/// executable bit).
fn binaries(dir: &Path) -> Result<Vec<String>> {
    use std::os::unix::fs::PermissionsExt;
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let meta = entry.metadata()?;
        if meta.is_file() && meta.permissions().mode() & 0o111 != 0 && path.extension().is_none() {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// The first ELF section whose contents differ, or the first differing offset.
fn first_difference(a: &PathBuf, b: &PathBuf) -> Result<String> {
    let (da, db) = (std::fs::read(a)?, std::fs::read(b)?);
    if let (Ok(fa), Ok(fb)) = (object::File::parse(&*da), object::File::parse(&*db)) {
        for sa in fa.sections() {
            let name = sa.name().unwrap_or("?");
            match fb.section_by_name(name) {
                None => return Ok(format!("section {name} only in the first")),
                Some(sb) => {
                    if sa.data().ok() != sb.data().ok() {
                        return Ok(format!("first differing section: {name}"));
                    }
                }
            }
        }
    }
    let offset = da
        .iter()
        .zip(&db)
        .position(|(x, y)| x != y)
        .unwrap_or(da.len().min(db.len()));
    Ok(format!(
        "first differing byte at offset {offset}; sizes {} and {}",
        da.len(),
        db.len()
    ))
}
