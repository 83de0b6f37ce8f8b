//! The programs a build needs: pinned ones unpacked from wheels, and the
//! host's, checked up front so a missing one is named clearly with the
//! system package that provides it ([`SYSTEM_PACKAGES`], which `cargo xtask
//! setup` installs).

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, anyhow};

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Tool, for_system};
use build_support::unpack;

/// A Debian/Ubuntu package that kiln's build scripts and steps need.
pub struct SystemPackage {
    pub name: &'static str,
    /// The programs of it that the steps run: each is checked before use
    /// ([`crate::tools::require_host_program`]), and a missing one is named
    /// with this package and `cargo xtask setup`.
    pub programs: &'static [&'static str],
    pub purpose: &'static str,
}

const fn package(
    name: &'static str,
    programs: &'static [&'static str],
    purpose: &'static str,
) -> SystemPackage {
    SystemPackage {
        name,
        programs,
        purpose,
    }
}

/// Every system package that a build script or step needs, and the programs
/// it provides: the one table that `setup` installs from and that the
/// checks' messages name packages from, so that the two cannot drift.
#[rustfmt::skip]
pub const SYSTEM_PACKAGES: [SystemPackage; 23] = [
    package("build-essential", &["cc", "c++"], "C/C++ compilers for the IREE runtime and the shim"),
    package("pkg-config", &["pkg-config"], "kiln-iree's build script reads the prefix's link recipe"),
    package("libclang-dev", &[], "bindgen in kiln-iree's build script; cargo xtask nix-build's libclang"),
    package("clang-14", &["clang-14"], "cargo xtask kernels: kiln's CUDA kernels' PTX from their source"),
    package("patch", &["patch"], "applies nix/iree-patches to the IREE source"),
    package("git", &["git"], "the checkout's files (git ls-files); cargo xtask nix-build: the host package set"),
    package("python3", &["python3"], "the linters' and clients' virtual environments; cargo xtask nix-build's Jinja2"),
    package("rsync", &["rsync"], "cargo xtask nix-build: the host package set"),
    package("patchelf", &["patchelf"], "cargo xtask nix-build: the host package set"),
    package("jq", &["jq"], "cargo xtask nix-build: the host package set"),
    package("zstd", &["zstd"], "cargo xtask nix-build: the host package set"),
    package("curl", &["curl"], "cargo xtask nix-build: the host package set"),
    package("unzip", &["unzip"], "cargo xtask nix-build: the host package set"),
    package("python3-jinja2", &[], "cargo xtask nix-build: the tests' Jinja2, from the host's python3"),
    package("ca-certificates", &[], "HTTPS downloads of the pinned inputs"),
    package("nix-bin", &["nix-instantiate", "nix-build", "nix-store", "nix-hash", "nix-shell", "nix"], "lint-nix, eval-nix and nix-build: Debian's Nix"),
    package("python3-venv", &[], "the workflow linters' virtual environment"),
    package("shellcheck", &["shellcheck"], "actionlint's check of every `run:` script"),
    package("valgrind", &["valgrind"], ".ci/hardening: an iree-cpu decode under memcheck"),
    package("gcc-aarch64-linux-gnu", &["aarch64-linux-gnu-gcc"], "the aarch64 (GB10) IREE prefix and link, cross-compiled"),
    package("g++-aarch64-linux-gnu", &["aarch64-linux-gnu-g++"], "the aarch64 IREE prefix's C++ (CMake)"),
    package("libc6-dev-arm64-cross", &[], "the aarch64 sysroot"),
    package("qemu-user", &["qemu-aarch64"], "the aarch64 tests, under qemu-aarch64"),
];

/// The package in [`SYSTEM_PACKAGES`] that provides `program`.
pub fn package_of(program: &str) -> Option<&'static str> {
    SYSTEM_PACKAGES
        .iter()
        .find(|p| p.programs.contains(&program))
        .map(|p| p.name)
}

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

/// How to get `program`: `cargo xtask setup`, the one command that installs
/// every system package the steps need, and the Debian/Ubuntu package of it
/// ([`SYSTEM_PACKAGES`]).
pub fn install_hint(program: &str) -> String {
    match package_of(program) {
        Some(package) => package_hint(package),
        // Every program the steps check for is in the table (a test holds
        // them to it); this is for one that slipped through.
        None => "install it and put it on PATH (`cargo xtask setup` installs the system \
                 packages kiln's steps need)"
            .to_string(),
    }
}

/// How to get the system package `package`: `cargo xtask setup`, or apt.
pub fn package_hint(package: &str) -> String {
    format!(
        "`cargo xtask setup` installs it (Debian/Ubuntu package {package}: \
         apt-get install -y {package})"
    )
}

/// Runs `program --version` and returns its first line, or an error that says
/// what the program is for, which package provides it and that `cargo xtask
/// setup` installs it.
pub fn require_host_program(program: &str, purpose: &str) -> Result<String> {
    let output = Command::new(program)
        .arg("--version")
        .output()
        .map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound => "was not found on PATH".to_string(),
                _ => format!("could not be run ({e})"),
            };
            anyhow!("`{program}` ({purpose}) {why}; {}", install_hint(program))
        })?;
    if !output.status.success() {
        return Err(anyhow!(
            "`{program}` ({purpose}) did not run: `{program} --version` failed ({}); {}",
            output.status,
            install_hint(program)
        ));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text.lines().next().unwrap_or_default().to_string())
}

/// Fails unless every one of `programs` is on PATH, naming all the missing
/// ones at once with their packages, so that one install fixes it.
pub fn require_host_programs(programs: &[&str], purpose: &str) -> Result<()> {
    let missing: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|program| which::which(program).is_err())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut packages: Vec<&str> = Vec::new();
    for package in missing.iter().filter_map(|p| package_of(p)) {
        if !packages.contains(&package) {
            packages.push(package);
        }
    }
    Err(anyhow!(
        "{purpose} needs {}, not found on PATH: `cargo xtask setup` installs them \
         (Debian/Ubuntu: apt-get install -y {})",
        missing.join(", "),
        packages.join(" ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hint names the package and setup; a program that is not there,
    /// or several, are named with setup.
    #[test]
    fn a_missing_program_is_named_with_its_package_and_setup() {
        let hint = install_hint("patchelf");
        assert!(hint.contains("cargo xtask setup"), "{hint}");
        assert!(hint.contains("apt-get install -y patchelf"), "{hint}");
        let hint = install_hint("aarch64-linux-gnu-gcc");
        assert!(hint.contains("gcc-aarch64-linux-gnu"), "{hint}");
        // A program in no package still points at setup.
        assert!(install_hint("kiln-no-such-program").contains("cargo xtask setup"));
        let error = require_host_program("kiln-no-such-program", "a test")
            .unwrap_err()
            .to_string();
        assert!(error.contains("`kiln-no-such-program` (a test)"), "{error}");
        assert!(error.contains("cargo xtask setup"), "{error}");
        let error = require_host_programs(&["kiln-no-such-program", "sh"], "a test")
            .unwrap_err()
            .to_string();
        assert!(error.contains("needs kiln-no-such-program,"), "{error}");
        assert!(!error.contains("sh,"), "{error}");
        assert!(require_host_programs(&["sh"], "a test").is_ok());
    }

    /// With no PATH to find them on, the programs of the table are reported
    /// missing with their package and `cargo xtask setup`: the test runs
    /// itself again in a child whose PATH holds nothing.
    #[test]
    fn a_program_of_the_table_missing_from_path_is_named_with_its_package() {
        let name =
            "tools::tests::a_program_of_the_table_missing_from_path_is_named_with_its_package";
        if !crate::rerun::in_child() {
            let empty = tempfile::tempdir().unwrap();
            crate::rerun::run_child(name, |exe| {
                let mut child = Command::new(exe);
                child.env("PATH", empty.path());
                child
            });
            return;
        }
        for (program, package) in [
            ("pkg-config", "pkg-config"),
            ("clang-14", "clang-14"),
            ("nix-instantiate", "nix-bin"),
            ("qemu-aarch64", "qemu-user"),
        ] {
            let error = require_host_program(program, "a test")
                .unwrap_err()
                .to_string();
            eprintln!("{error}");
            assert!(
                error.contains(&format!("`{program}` (a test) was not found")),
                "{error}"
            );
            assert!(error.contains("`cargo xtask setup` installs it"), "{error}");
            assert!(
                error.contains(&format!("apt-get install -y {package}")),
                "{error}"
            );
        }
        let error = require_host_programs(&nix_harness::build::HOST_PROGRAMS, "the Nix build")
            .unwrap_err()
            .to_string();
        eprintln!("{error}");
        assert!(error.contains("rsync"), "{error}");
        assert!(
            error.contains("apt-get install -y nix-bin build-essential jq zstd rsync unzip patchelf pkg-config curl git python3"),
            "{error}"
        );
    }
}
