//! `cargo xtask compiler`: the pinned `iree-compile`, unpacked from its wheel
//! (no pip, no Python) and checked against the pinned revision.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, anyhow};

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Pins, for_system, host_system};
use crate::unpack;

/// The folder the pinned compiler wheel unpacks to (it may not exist yet).
fn compiler_dir(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    let system = host_system()?;
    let wheel = for_system(
        &pins.iree.compiler.wheels,
        &system,
        "iree-base-compiler wheel",
    )?;
    Ok(cache.path("iree-compiler").join(&wheel.sha256[..16]))
}

/// Where the compiler of the current pins lives (it may not exist yet).
pub fn compiler_location(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    Ok(compiler_dir(cache, pins)?.join(&pins.iree.compiler.binary))
}

/// Fetches and unpacks the compiler if needed, then checks its revision.
pub fn install(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    let system = host_system()?;
    let wheel = for_system(
        &pins.iree.compiler.wheels,
        &system,
        "iree-base-compiler wheel",
    )?;
    cache.publish(&compiler_dir(cache, pins)?, |staging| {
        let archive = fetch(cache, wheel)?;
        eprintln!("unpacking {}", wheel.name);
        unpack::wheel(&archive, staging)
    })?;
    let binary = compiler_location(cache, pins)?;
    check_revision(&binary, pins)?;
    Ok(binary)
}

/// Runs `iree-compile --version` and compares the revision after `@` with
/// the pinned one: a compiler from another revision builds modules the
/// runtime may reject, or worse, misread.
pub fn check_revision(binary: &PathBuf, pins: &Pins) -> Result<String> {
    let output = Command::new(binary)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run {}", binary.display()))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(anyhow!(
            "`{} --version` failed ({}):\n{text}",
            binary.display(),
            output.status
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
    Ok(text.lines().next().unwrap_or_default().trim().to_string())
}
