//! The flake's harness on a machine with Debian's Nix (2.8) and no nixpkgs:
//! - [`eval`]: every output of `flake.nix`, for every system, evaluated and
//!   instantiated with real nixpkgs `lib`, crane and rust-overlay and the
//!   stand-in `nix/eval/nixpkgs-stand-in.nix`, into `nix/eval/summary.json`
//!   (`cargo xtask eval-nix`);
//! - [`build`]: the flake's packages and checks built by real Nix against
//!   kiln's host-backed package set, `nix/build/host-nixpkgs.nix`
//!   (`cargo xtask nix-build`);
//! - [`inputs`]: the locked GitHub inputs both need, checked against
//!   `flake.lock`'s NAR hashes;
//! - [`lint`]: every Nix file parsed, formatted and free of dead code
//!   (`cargo xtask lint-nix`).
//!
//! The Nix files stay beside the flake (`nix/eval`, `nix/build`); this crate
//! drives them. It knows nothing of xtask's cache or tools: the caller finds
//! the host's programs, provides the inputs and copies the checkout.

pub mod build;
mod controls;
mod driver;
pub mod eval;
pub mod inputs;
pub mod lint;

use std::fs::File;
use std::path::Path;
use std::process::{Command, ExitStatus, Output};

use anyhow::{Context, Result, anyhow};
use sha2::{Digest, Sha256};

/// The checkout whose flake is evaluated or built.
pub struct Checkout<'a> {
    /// Its root: the Nix drivers are read, and the summary written, here.
    pub root: &'a Path,
    /// Copies its files, as a flake sees its source (what git tracks), to a
    /// folder that does not exist yet.
    pub copy: &'a dyn Fn(&Path) -> Result<()>,
}

impl Checkout<'_> {
    fn copy_to(&self, dest: &Path) -> Result<()> {
        (self.copy)(dest)
    }
}

/// The way this crate runs a program and captures its output; whether it
/// succeeded is the caller's to judge.
fn output(command: &mut Command) -> Result<Output> {
    command
        .output()
        .with_context(|| format!("cannot run {:?}", command.get_program()))
}

/// Runs a program that must succeed; its stdout, trimmed. A failure carries
/// its stderr.
fn read(command: &mut Command) -> Result<String> {
    let out = output(command)?;
    if !out.status.success() {
        return Err(anyhow!(
            "{command:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs a program whose output the user watches (a build's log).
fn status(command: &mut Command) -> Result<ExitStatus> {
    command
        .status()
        .with_context(|| format!("cannot run {:?}", command.get_program()))
}

/// Hex sha256 of a file's bytes (the summary's `read` table).
fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}
