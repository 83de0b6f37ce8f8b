//! `cargo xtask setup` (and the first step of `cargo xtask test`): everything
//! the suite (and, for `setup`, `cargo xtask nix-build`) needs that a fresh
//! Debian/Ubuntu machine with only rustup lacks.
//! - the system packages of [`SYSTEM_PACKAGES`] (tools.rs), through apt when this user
//!   is root or has password-less sudo; otherwise the exact apt command, and
//!   a stop. The same table names the package in every check's message for a
//!   missing program ([`crate::tools::require_host_program`]);
//! - nixpkgs-fmt and deadnix (and for `setup`, cargo-nextest where none is on
//!   PATH), built with `cargo install --locked` from their crates, pinned here
//!   by version and sha256;
//! - the workflow linters (`.ci/requirements-lint.txt`, hash-pinned) in a
//!   virtual environment of their own;
//! - the official OpenAI Python client (`.ci/requirements-openai.txt`,
//!   hash-pinned) in another, for the kiln-server client test.
//!
//! The tools land in the cache (`$KILN_CACHE_DIR/tools`), named by what went
//! into them; nothing is installed into `~/.cargo/bin` or the system Python.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Download, repo_root};
use crate::tools::{SYSTEM_PACKAGES, package_of};
use build_support::digest::{content_key, sha256_file};
use build_support::unpack;

/// A crates.io binary crate, pinned by version and the sha256 of its `.crate`
/// (the `cksum` in the crates.io index).
struct CargoTool {
    name: &'static str,
    version: &'static str,
    sha256: &'static str,
    /// Needed by `cargo xtask nix-build` alone, which takes the one on PATH
    /// when there is one (these machines come with cargo-nextest): built by
    /// `cargo xtask setup` only where none is, never by `cargo xtask test`.
    nix_build_only: bool,
}

const CARGO_TOOLS: [CargoTool; 3] = [
    CargoTool {
        name: "nixpkgs-fmt",
        version: "1.3.0",
        sha256: "1f1bdfcb88bb9dc3ae8a6ef55cda89eb33d7c69a98411b4cdb845adf391a7587",
        nix_build_only: false,
    },
    CargoTool {
        name: "deadnix",
        version: "1.2.1",
        sha256: "35d39f9234cf8779f4734f62782e5312a85aa40b7dd0ef05a525f785113aa536",
        nix_build_only: false,
    },
    CargoTool {
        name: "cargo-nextest",
        version: "0.9.143",
        sha256: "82c78e1bf2be79fd08f8665d9760dd9f954e4c62ae5d8d08f70a1741347a295b",
        nix_build_only: true,
    },
];

/// What `run` installs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// What `cargo xtask test` runs.
    Suite,
    /// That, and what `cargo xtask nix-build` needs besides (`cargo xtask
    /// setup`).
    Everything,
}

/// A hash-pinned virtual environment: its folder's name and requirements.
pub struct Venv {
    name: &'static str,
    requirements: &'static str,
}

/// The hash-pinned Python tools: actionlint, zizmor, pyflakes.
const LINT_VENV: Venv = Venv {
    name: "lint-venv",
    requirements: ".ci/requirements-lint.txt",
};

/// The `openai` package, for tests/openai_client.py.
pub const OPENAI_VENV: Venv = Venv {
    name: "openai-venv",
    requirements: ".ci/requirements-openai.txt",
};

/// Jinja2, for the released chat templates of tests/released_files.rs.
pub const JINJA_VENV: Venv = Venv {
    name: "jinja-venv",
    requirements: ".ci/requirements-jinja.txt",
};

/// Written last into a finished virtual environment. A venv cannot be built
/// elsewhere and renamed (its scripts name their interpreter by absolute
/// path), so a folder without it is a half-made one and is rebuilt.
const VENV_COMPLETE: &str = ".kiln-complete";

/// The folders of the tools `setup` installs, searched before `PATH`.
pub struct Toolbox {
    bin_dirs: Vec<PathBuf>,
    /// Searched after `bin_dirs`; the process's `PATH` unless a test says.
    search_path: Option<OsString>,
}

impl Toolbox {
    /// The tools already installed in the cache (none are installed here).
    pub fn installed(cache: &Cache) -> Result<Toolbox> {
        let mut bin_dirs: Vec<PathBuf> = CARGO_TOOLS
            .iter()
            .map(|tool| cargo_tool_dir(cache, tool).join("bin"))
            .collect();
        bin_dirs.push(venv_dir(cache, &LINT_VENV)?.join("bin"));
        bin_dirs.retain(|dir| dir.is_dir());
        Ok(Toolbox {
            bin_dirs,
            search_path: None,
        })
    }

    /// The tools' folders, each named by what was installed there: part of
    /// the key of a step that runs them.
    pub fn identity(&self) -> String {
        let dirs: Vec<String> = self
            .bin_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        dirs.join(":")
    }

    /// Only `bin_dirs`, then `search_path` (for tests).
    #[cfg(test)]
    pub fn with_dirs(bin_dirs: Vec<PathBuf>, search_path: &str) -> Toolbox {
        Toolbox {
            bin_dirs,
            search_path: Some(search_path.into()),
        }
    }

    /// The path of `program`: from the cache's tools, else from `PATH`.
    pub fn find(&self, program: &str, purpose: &str) -> Result<PathBuf> {
        let mut installed = self.bin_dirs.iter().map(|dir| dir.join(program));
        if let Some(path) = installed.find(|path| path.is_file()) {
            return Ok(path);
        }
        let path = self
            .search_path
            .clone()
            .or_else(|| std::env::var_os("PATH"));
        which::which_in(program, path, repo_root()).map_err(|_| {
            let how = match package_of(program) {
                Some(_) => crate::tools::install_hint(program),
                None => "`cargo xtask setup` installs it".to_string(),
            };
            anyhow!("`{program}` ({purpose}) is not installed; {how} (or put it on PATH)")
        })
    }
}

/// Installs what `scope` needs; returns where the tools are.
pub fn run(cache: &Cache, scope: Scope) -> Result<Toolbox> {
    system_packages()?;
    rust_targets()?;
    for tool in &CARGO_TOOLS {
        if tool.nix_build_only && (scope == Scope::Suite || which::which(tool.name).is_ok()) {
            continue;
        }
        install_cargo_tool(cache, tool)?;
    }
    for venv in [&LINT_VENV, &OPENAI_VENV, &JINJA_VENV] {
        install_venv(cache, venv)?;
    }
    let toolbox = Toolbox::installed(cache)?;
    eprintln!(
        "setup: system packages present; tools in {}",
        cache.path("tools").display()
    );
    Ok(toolbox)
}

/// The targets rust-toolchain.toml lists (the aarch64 standard library):
/// rustup installs them with a toolchain, not into one already installed.
fn rust_targets() -> Result<()> {
    if which::which("rustup").is_err() {
        // Nix's toolchain comes with the file's targets.
        return Ok(());
    }
    crate::process::run(
        Command::new("rustup")
            .args(["target", "add", crate::target::AARCH64])
            .current_dir(repo_root()),
        "rustup target add (the aarch64 standard library)",
    )
}

/// Installs the missing system packages, or says how to.
fn system_packages() -> Result<()> {
    let names: Vec<&str> = SYSTEM_PACKAGES.iter().map(|p| p.name).collect();
    if which::which("dpkg-query").is_err() {
        eprintln!(
            "setup: not a Debian/Ubuntu system (no dpkg-query); install the equivalents of: {}",
            names.join(" ")
        );
        return Ok(());
    }
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|name| !dpkg_installed(name))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let install = format!(
        "apt-get update && apt-get install -y --no-install-recommends {}",
        missing.join(" ")
    );
    let why: Vec<String> = SYSTEM_PACKAGES
        .iter()
        .filter(|p| missing.contains(&p.name))
        .map(|p| format!("  {}: {}", p.name, p.purpose))
        .collect();
    // apt-get as root, else through password-less sudo, else a stop.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    let sudo = !root && succeeds(Command::new("sudo").args(["-n", "true"]));
    if !root && !sudo {
        return Err(anyhow!(
            "missing system packages:\n{}\nrun as root: {install}",
            why.join("\n")
        ));
    }
    eprintln!("setup: installing {}", missing.join(" "));
    let apt = |args: &[&str]| -> Result<()> {
        let mut command = Command::new(if sudo { "sudo" } else { "apt-get" });
        if sudo {
            command.args(["-n", "apt-get"]);
        }
        crate::process::run(
            command.args(args).env("DEBIAN_FRONTEND", "noninteractive"),
            &format!("`apt-get {}`", args.join(" ")),
        )
        .with_context(|| format!("install by hand: {install}"))
    };
    apt(&["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&missing);
    apt(&args)
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Status}", package])
        .output()
        .is_ok_and(|out| out.status.success() && out.stdout == b"installed")
}

/// Whether `command` runs and exits 0 (its output unseen).
fn succeeds(command: &mut Command) -> bool {
    command.output().is_ok_and(|out| out.status.success())
}

fn cargo_tool_dir(cache: &Cache, tool: &CargoTool) -> PathBuf {
    cache.path("tools").join(format!(
        "{}-{}-{}",
        tool.name,
        tool.version,
        &tool.sha256[..16]
    ))
}

/// Fetches the pinned `.crate`, checks its sha256 and builds it with its own
/// Cargo.lock (`--locked`) into the cache.
fn install_cargo_tool(cache: &Cache, tool: &CargoTool) -> Result<()> {
    let dest = cargo_tool_dir(cache, tool);
    if cache.reusable(&dest)? {
        return Ok(());
    }
    let crate_name = format!("{}-{}", tool.name, tool.version);
    let pin = Download {
        name: format!("{crate_name}.crate"),
        url: format!(
            "https://static.crates.io/crates/{}/{crate_name}.crate",
            tool.name
        ),
        sha256: tool.sha256.into(),
    };
    let archive = fetch(cache, &pin)?;
    std::fs::create_dir_all(cache.path("staging"))?;
    // Removed when dropped: the unpacked source and cargo's target folder.
    let build = tempfile::Builder::new()
        .prefix("cargo-tool-")
        .tempdir_in(cache.path("staging"))
        .context("cannot create a build folder in the cache")?;
    unpack::tar_gz(&archive, build.path())?;
    let source = build.path().join(&crate_name);
    own_workspace(&source.join("Cargo.toml"))?;
    cache.publish(&dest, |staging| {
        eprintln!("setup: cargo install --locked {crate_name}");
        crate::process::run(
            crate::process::cargo()
                .args(["install", "--locked", "--quiet", "--path"])
                .arg(&source)
                .arg("--root")
                .arg(staging)
                .arg("--target-dir")
                .arg(build.path().join("target"))
                .current_dir(build.path())
                // Someone else's crate: its warnings are not ours to see, and a
                // `-D warnings` in the caller's RUSTFLAGS must not fail its build.
                .env("RUSTFLAGS", "--cap-lints=allow"),
            &format!("`cargo install --locked {crate_name}`"),
        )
    })?;
    Ok(())
}

/// Makes an unpacked crate the root of its own workspace. The cache may lie
/// inside a checkout (CI keeps it in `target/`), and cargo then takes the
/// checkout's `[workspace]` for the crate's own and refuses to build it.
fn own_workspace(manifest: &Path) -> Result<()> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("cannot read {}", manifest.display()))?;
    if !text.lines().any(|line| line.trim() == "[workspace]") {
        std::fs::write(manifest, format!("{text}\n[workspace]\n"))
            .with_context(|| format!("cannot write {}", manifest.display()))?;
    }
    Ok(())
}

/// The Python of `venv`, which must be installed (by [`run`]).
pub fn venv_python(cache: &Cache, venv: &Venv) -> Result<PathBuf> {
    let python = venv_dir(cache, venv)?.join("bin/python");
    if !python.is_file() {
        return Err(anyhow!(
            "{} is missing; `cargo xtask setup` installs it",
            python.display()
        ));
    }
    Ok(python)
}

/// The venv's folder, named by the requirements and the Python that runs it.
fn venv_dir(cache: &Cache, venv: &Venv) -> Result<PathBuf> {
    let requirements = repo_root().join(venv.requirements);
    let python = crate::process::read(Command::new("python3").arg("--version")).unwrap_or_default();
    let key = content_key(&serde_json::json!({
        "requirements": sha256_file(&requirements)?,
        "python": python,
    }));
    Ok(cache
        .path("tools")
        .join(format!("{}-{}", venv.name, &key[..16])))
}

fn install_venv(cache: &Cache, venv: &Venv) -> Result<()> {
    let dir = venv_dir(cache, venv)?;
    if dir.join(VENV_COMPLETE).exists() {
        return Ok(());
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("cannot remove the half-made {}", dir.display()))?;
    }
    let result = build_venv(&dir, venv.requirements);
    if result.is_err() {
        // Leave nothing that looks like a venv behind.
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn build_venv(dir: &Path, requirements: &str) -> Result<()> {
    eprintln!("setup: {requirements} into {}", dir.display());
    crate::process::run(
        Command::new("python3").arg("-m").arg("venv").arg(dir),
        "python3 -m venv (Debian/Ubuntu: apt-get install -y python3-venv)",
    )?;
    crate::process::run(
        Command::new(dir.join("bin/pip"))
            .args(["install", "--quiet", "--require-hashes", "--no-deps", "-r"])
            .arg(repo_root().join(requirements)),
        &format!("pip install --require-hashes -r {requirements}"),
    )?;
    std::fs::write(dir.join(VENV_COMPLETE), b"")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo metadata` on `manifest`: does cargo accept it as a package?
    fn cargo_accepts(manifest: &Path) -> bool {
        crate::process::cargo()
            .args([
                "metadata",
                "--offline",
                "--no-deps",
                "--format-version",
                "1",
            ])
            .arg("--manifest-path")
            .arg(manifest)
            .output()
            .is_ok_and(|out| out.status.success())
    }

    /// The lint stops on the finder's error for a missing program
    /// (crates/workflow-lint's tests); the toolbox's error names setup.
    #[test]
    fn a_missing_linter_is_named_with_setup() {
        let tools = Toolbox::with_dirs(Vec::new(), "");
        for program in ["actionlint", "zizmor", "shellcheck", "pyflakes"] {
            let error = tools.find(program, "a test").unwrap_err().to_string();
            assert!(
                error.contains(&format!("`{program}` (a test)"))
                    && error.contains("cargo xtask setup"),
                "{error}"
            );
        }
    }

    #[test]
    fn a_tool_crate_unpacked_inside_a_checkout_builds_as_its_own_workspace() {
        let checkout = tempfile::tempdir().unwrap();
        std::fs::write(
            checkout.path().join("Cargo.toml"),
            "[workspace]\nmembers = []\n",
        )
        .unwrap();
        // Where CI's cache puts an unpacked tool crate: below the checkout.
        let source = checkout.path().join("target/kiln-cache/staging/tool-1.0.0");
        std::fs::create_dir_all(source.join("src")).unwrap();
        std::fs::write(source.join("src/main.rs"), "fn main() {}\n").unwrap();
        let manifest = source.join("Cargo.toml");
        std::fs::write(
            &manifest,
            "[package]\nname = \"tool\"\nversion = \"1.0.0\"\nedition = \"2021\"\n",
        )
        .unwrap();
        assert!(
            !cargo_accepts(&manifest),
            "cargo took a crate below a workspace for a package of its own"
        );
        own_workspace(&manifest).unwrap();
        assert!(cargo_accepts(&manifest));
        // Idempotent: a second call adds no second table.
        own_workspace(&manifest).unwrap();
        assert!(cargo_accepts(&manifest));
    }
}
