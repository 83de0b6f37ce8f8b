//! `cargo xtask compiler`: the pinned `iree-compile`, unpacked from its wheel
//! (no pip, no Python) and checked against the pinned revision.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, anyhow};

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Download, Pins, for_system};
use crate::target::Target;
use build_support::digest::content_key;
use build_support::unpack;

/// The pinned compiler wheel of this machine.
fn pinned_wheel(pins: &Pins) -> Result<&Download> {
    for_system(
        &pins.iree.compiler.wheels,
        Target::host()?.system,
        "iree-base-compiler wheel",
    )
}

/// The folder the pinned compiler files unpack to (it may not exist yet),
/// named by the wheel and the file list.
pub fn compiler_dir(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    let key = content_key(&serde_json::json!({
        "wheel": pinned_wheel(pins)?.sha256,
        "files": pins.iree.compiler.files,
    }));
    Ok(cache.path("iree-compiler").join(&key[..16]))
}

/// Where the compiler of the current pins lives (it may not exist yet).
pub fn compiler_location(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    Ok(compiler_dir(cache, pins)?.join(&pins.iree.compiler.binary))
}

/// Fetches and unpacks the compiler if needed, then checks its revision;
/// returns its path and the version line it printed.
pub fn install(cache: &Cache, pins: &Pins) -> Result<(PathBuf, String)> {
    let wheel = pinned_wheel(pins)?;
    cache.publish(&compiler_dir(cache, pins)?, |staging| {
        let archive = fetch(cache, wheel)?;
        eprintln!("unpacking {}", wheel.name);
        unpack_files(&archive, staging, pins)
    })?;
    let binary = compiler_location(cache, pins)?;
    let version = check_revision(&binary, pins)?;
    Ok((binary, version))
}

/// Unpacks exactly the files of the pin (`iree.compiler.files`), the ones
/// the Nix package installs: the compiler tested here is the one Nix ships.
fn unpack_files(archive: &Path, dest: &Path, pins: &Pins) -> Result<()> {
    let compiler = &pins.iree.compiler;
    let folder = Path::new(&compiler.binary).parent();
    if !compiler.files.contains(&compiler.binary)
        || compiler
            .files
            .iter()
            .any(|f| Path::new(f).parent() != folder)
    {
        return Err(anyhow!(
            "nix/pins.json: iree.compiler.files must hold `binary` and only files beside it (Nix installs them in one folder)"
        ));
    }
    unpack::wheel_members(archive, dest, &compiler.files)
}

/// Runs `iree-compile --version` and compares the revision after `@` with
/// the pinned one (a compiler from another revision builds modules the
/// runtime may reject, or worse, misread), then the whole version line.
fn check_revision(binary: &Path, pins: &Pins) -> Result<String> {
    let (status, text) = crate::process::output_text(Command::new(binary).arg("--version"))?;
    if !status.success() {
        return Err(anyhow!(
            "`{} --version` failed ({status}):\n{text}",
            binary.display()
        ));
    }
    let found = text
        .lines()
        .find_map(|line| {
            line.split_once(" @ ")
                .map(|(_, rev)| rev.trim().to_string())
        })
        .ok_or_else(|| {
            anyhow!("`iree-compile --version` printed no `VERSION @ REVISION`:\n{text}")
        })?;
    if found != pins.iree.revision {
        return Err(anyhow!(
            "iree-compile revision mismatch\n  pinned (nix/pins.json): {}\n  found ({}): {found}\n\
             Modules from another revision may not load in the runtime built from the pin.",
            pins.iree.revision,
            binary.display()
        ));
    }
    let expected = &pins.iree.compiler.version_line;
    let line = text
        .lines()
        .find(|line| line.contains(" @ "))
        .unwrap_or_default()
        .trim();
    if !line.ends_with(expected.as_str()) {
        return Err(anyhow!(
            "iree-compile version mismatch\n  pinned (nix/pins.json): {expected}\n  found ({}): {line}",
            binary.display()
        ));
    }
    Ok(line.to_string())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// With exactly the pinned files (what Nix installs), iree-compile builds
    /// an llvm-cpu module: that target needs iree-lld beside the binary.
    #[test]
    fn the_pinned_files_compile_an_llvm_cpu_module() {
        let pins = Pins::of_checkout().unwrap();
        let wheel = pinned_wheel(&pins).unwrap();
        let cache = Cache::open().unwrap();
        let archive = cache
            .path("downloads")
            .join(&wheel.sha256)
            .join(&wheel.name);
        if !archive.exists() {
            eprintln!(
                "skipped: the compiler wheel is not in the cache ({}); `cargo xtask compiler` fetches it",
                archive.display()
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        unpack_files(&archive, dir.path(), &pins).unwrap();
        let module = dir.path().join("add.mlir");
        std::fs::write(
            &module,
            "func.func @add(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {\n  \
             %0 = arith.addf %a, %b : tensor<4xf32>\n  return %0 : tensor<4xf32>\n}\n",
        )
        .unwrap();
        let output = Command::new(dir.path().join(&pins.iree.compiler.binary))
            .args([
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=generic",
                "-o",
            ])
            .arg(dir.path().join("add.vmfb"))
            .arg(&module)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "iree-compile failed with the pinned files:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            std::fs::metadata(dir.path().join("add.vmfb"))
                .unwrap()
                .len()
                > 0
        );
    }

    /// The pinned version line is accepted; another revision is refused
    /// with both revisions printed, and so is the pinned revision with
    /// another version.
    #[test]
    fn only_the_pinned_version_line_is_accepted() {
        let pins = Pins::of_checkout().unwrap();
        let dir = tempfile::tempdir().unwrap();
        // A stand-in `iree-compile` named `name` that prints `line`.
        let check = |name: &str, line: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\necho '{line}'\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            check_revision(&path, &pins)
        };
        let pinned = format!("IREE compiler version {}", pins.iree.compiler.version_line);
        assert_eq!(check("pinned", &pinned).unwrap(), pinned);
        let other = "0123456789abcdef0123456789abcdef01234567";
        let line = format!("IREE compiler version 3.11.0 @ {other}");
        let error = check("other-revision", &line).unwrap_err().to_string();
        assert!(error.contains("revision mismatch"), "{error}");
        assert!(error.contains(other), "{error}");
        assert!(error.contains(&pins.iree.revision), "{error}");
        let line = format!("IREE compiler version 9.9.9 @ {}", pins.iree.revision);
        let error = check("other-version", &line).unwrap_err().to_string();
        assert!(error.contains("version mismatch"), "{error}");
    }
}
