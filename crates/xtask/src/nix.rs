//! `cargo xtask eval-nix`, `nix-build` and `lint-nix`: what they need from
//! this machine (Debian's Nix and the host's tools, checked with their
//! packages named; the flake's locked inputs, from a folder or downloaded
//! into the cache; the checkout's Nix files), handed to the flake's harness,
//! `crates/nix-harness`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};
use build_support::download::stream_to_temp;
use nix_harness::inputs::{Inputs, locked, verify};
use nix_harness::{Checkout, build, eval};

use crate::cache::Cache;
use crate::pins::repo_root;
use crate::setup::Toolbox;
use crate::tools::{package_hint, require_host_program, require_host_programs};
use build_support::tree::{copy_checkout, source_files};

/// `cargo xtask eval-nix [--inputs DIR]`.
pub fn eval(cache: &Cache, inputs_dir: Option<&Path>) -> Result<()> {
    require_host_programs(&eval::PROGRAMS, "cargo xtask eval-nix")?;
    let inputs = inputs(cache, inputs_dir)?;
    with_checkout(|checkout| eval::run(checkout, &inputs))
}

/// `cargo xtask eval-nix --check`: the committed summary is current.
pub fn eval_check() -> Result<()> {
    eval::check(&repo_root())
}

/// `cargo xtask lint-nix`: the checkout's Nix files, linted with the
/// linters `setup` installs.
pub fn lint(tools: &Toolbox) -> Result<()> {
    let root = repo_root();
    let files: Vec<PathBuf> = source_files(&root)?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "nix"))
        .collect();
    require_host_program("nix-instantiate", "parses the Nix files")?;
    let nixpkgs_fmt = tools.find("nixpkgs-fmt", "the flake's formatter")?;
    let deadnix = tools.find("deadnix", "finds dead Nix code")?;
    nix_harness::lint::run(&root, &files, &nixpkgs_fmt, &deadnix)
}

/// `cargo xtask nix-build`'s options.
#[derive(clap::Args)]
pub struct BuildOptions {
    /// As for eval-nix: nixpkgs-lib/, crane/, rust-overlay/ at flake.lock's
    /// revisions (default: downloaded from GitHub).
    #[arg(long)]
    inputs: Option<PathBuf>,
    /// Build in Nix's sandbox (nixbld users; the host's tool folders
    /// visible read-only, no network but for fixed-output downloads).
    #[arg(long)]
    sandbox: bool,
    /// Enter the contributor's shell (devShells.default) with nix-shell,
    /// after building its inputs, and run this command in it from the
    /// checkout (e.g. "cargo build --release --features cuda,xla-iree &&
    /// cargo xtask test --quick"); the shell is pure: only what it provides
    /// is on PATH.
    #[arg(long, value_name = "COMMAND", conflicts_with_all = ["attributes", "sandbox"])]
    shell: Option<String>,
    /// Outputs to build, e.g. checks.link (default: every package and check).
    attributes: Vec<String>,
}

/// `cargo xtask nix-build`.
pub fn build(cache: &Cache, options: BuildOptions) -> Result<()> {
    // Every missing program named at once, so that one install fixes it.
    require_host_programs(&build::HOST_PROGRAMS, "the Nix build's host package set")?;
    let host = find_host(cache)?;
    let inputs = inputs(cache, options.inputs.as_deref())?;
    let system = crate::target::Target::host()?.system;
    let options = build::Options {
        sandbox: options.sandbox,
        shell: options.shell,
        attributes: options.attributes,
    };
    with_checkout(|checkout| build::run(checkout, &inputs, &host, system, options))
}

/// This checkout, copied for the harness as xtask copies it everywhere.
fn with_checkout<T>(f: impl FnOnce(&Checkout) -> Result<T>) -> Result<T> {
    let root = repo_root();
    let copy = |dest: &Path| copy_checkout(&root, dest);
    f(&Checkout {
        root: &root,
        copy: &copy,
    })
}

fn inputs(cache: &Cache, dir: Option<&Path>) -> Result<Inputs> {
    match dir {
        Some(dir) => nix_harness::inputs::from_folder(&repo_root(), dir),
        None => download(cache),
    }
}

/// The inputs downloaded from GitHub by the lock file (owner, repo, rev),
/// each unpacked into the cache and checked against its NAR hash; nixpkgs
/// is the whole tree, of which the evaluation reads `lib/`.
fn download(cache: &Cache) -> Result<Inputs> {
    let (mut dirs, mut provenance) = (Vec::new(), serde_json::Map::new());
    for name in ["nixpkgs", "crane", "rust-overlay"] {
        let lock = locked(&repo_root(), name)?;
        let dest = cache
            .path("nix-inputs")
            .join(format!("{name}-{}", &lock.rev[..12]));
        let dest = cache.publish(&dest, |staging| {
            let url = format!(
                "https://github.com/{}/{}/archive/{}.tar.gz",
                lock.owner, lock.repo, lock.rev
            );
            // Its hash is not pinned: flake.lock pins what it unpacks to
            // (the NAR hash), which `verify` checks below.
            let (tarball, _) = stream_to_temp(&url, &url, &cache.path("staging"))?;
            let unpacked = staging.join("unpacked");
            build_support::unpack::tar_gz(tarball.path(), &unpacked)?;
            // GitHub's tarballs hold one top folder, `REPO-REV`.
            let top = std::fs::read_dir(&unpacked)?
                .next()
                .ok_or_else(|| anyhow!("{url} is an empty tarball"))??
                .path();
            std::fs::rename(&top, staging.join("tree"))?;
            std::fs::remove_dir_all(&unpacked)?;
            verify(name, &staging.join("tree"), &lock)
        })?;
        let how = "downloaded, NAR hash verified against flake.lock";
        let (owner, repo, rev) = (&lock.owner, &lock.repo, &lock.rev);
        provenance.insert(name.into(), format!("{owner}/{repo} {rev} ({how})").into());
        dirs.push(dest.join("tree"));
    }
    Ok(Inputs {
        nixpkgs_lib: dirs[0].clone(),
        crane: dirs[1].clone(),
        rust_overlay: dirs[2].clone(),
        provenance: provenance.into(),
    })
}

/// The host's tools the package set takes: the Rust toolchain (its real
/// folder: rustup's `1.95.0` is often a link to `stable`), the linters and
/// cargo-nextest `setup` installs, libclang.
fn find_host(cache: &Cache) -> Result<build::Host> {
    let sysroot = crate::process::read(Command::new("rustc").args(["--print", "sysroot"]))?;
    let version_line = crate::process::read(Command::new("rustc").arg("--version"))?;
    let rust_version = version_line
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow!("cannot read rustc's version from `{version_line}`"))?
        .to_string();
    let libclang = [
        "/usr/lib/llvm-14/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|d| d.join("libclang.so").exists() || d.join("libclang-14.so.1").exists())
    .ok_or_else(|| anyhow!("no libclang found; {}", package_hint("libclang-dev")))?;
    let toolbox = Toolbox::installed(cache)?;
    Ok(build::Host {
        bash: std::fs::canonicalize("/bin/bash")?,
        rust_toolchain: std::fs::canonicalize(&sysroot)
            .with_context(|| format!("rustc's sysroot {sysroot} does not exist"))?,
        rust_version,
        cargo_nextest: std::fs::canonicalize(
            toolbox.find("cargo-nextest", "the tests checks' test runner")?,
        )?,
        nixpkgs_fmt: toolbox.find("nixpkgs-fmt", "the nix-lint check")?,
        deadnix: toolbox.find("deadnix", "the nix-lint check")?,
        libclang,
    })
}
