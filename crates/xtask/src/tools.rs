//! The programs a build needs: pinned ones unpacked from wheels, and the
//! host's C toolchain, checked up front so a missing one is named clearly.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, anyhow};

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Tool, for_system};
use crate::unpack;

/// Fetches and unpacks a pinned tool wheel; returns the program's path.
pub fn pinned_tool(cache: &Cache, tool: &Tool, what: &str, system: &str) -> Result<PathBuf> {
    let pin = for_system(&tool.systems, system, what)?;
    let dir = cache.path("tools").join(&pin.sha256[..16]);
    let dir = cache.publish(&dir, |staging| {
        let wheel = fetch(cache, pin)?;
        unpack::wheel(&wheel, staging)
    })?;
    let program = dir.join(&tool.binary);
    // Some wheels store their scripts without the executable bit.
    let mut perms = std::fs::metadata(&program)
        .with_context(|| format!("{what} wheel has no {}", tool.binary))?
        .permissions();
    perms.set_mode(perms.mode() | 0o755);
    std::fs::set_permissions(&program, perms)?;
    Ok(program)
}

/// Runs `program --version` and returns its first line, or an error that says
/// what the program is for and how to install it.
pub fn require_host_program(program: &str, purpose: &str, install: &str) -> Result<String> {
    let output = Command::new(program)
        .arg("--version")
        .output()
        .map_err(|e| not_found(program, purpose, install, e))?;
    if !output.status.success() {
        return Err(anyhow!(
            "`{program} --version` failed ({}); {purpose} is needed: {install}",
            output.status
        ));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text.lines().next().unwrap_or_default().to_string())
}

fn not_found(program: &str, purpose: &str, install: &str, e: std::io::Error) -> anyhow::Error {
    anyhow!("`{program}` ({purpose}) was not found on PATH ({e}); install it: {install}")
}

/// The host C and C++ compilers that build IREE, with their identities (part
/// of the prefix's cache key: another compiler makes another prefix).
pub fn host_c_toolchain() -> Result<Vec<String>> {
    const HINT: &str = "Debian/Ubuntu: apt-get install -y build-essential";
    Ok(vec![
        require_host_program("cc", "the C compiler that builds IREE's runtime", HINT)?,
        require_host_program("c++", "the C++ compiler CMake requires for IREE", HINT)?,
    ])
}
