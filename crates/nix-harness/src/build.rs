//! `cargo xtask nix-build`: the flake's packages and checks built by real
//! Nix on this machine (Debian's nix-bin), from the flake's own Nix files,
//! with the locked crane and rust-overlay, nixpkgs' `lib`, and kiln's
//! host-backed package set (nix/build/host-nixpkgs.nix says what in it is
//! the host's). The store is the machine's `/nix/store`, kept between runs:
//! an output already there is reused by Nix, and said so here.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};

use crate::eval::nix_path;
use crate::inputs::Inputs;
use crate::{Checkout, read, status};

/// Every output `nix flake check` and `nix build` would build for this
/// system, cheapest first, so a broken package set fails early.
pub const ALL: [&str; 14] = [
    "checks.rustfmt",
    "checks.nix-lint",
    "packages.iree-compiler",
    "packages.iree-runtime",
    "packages.iree-runtime-cuda",
    "checks.link",
    "checks.mutations",
    "checks.clippy",
    "checks.tests",
    "checks.tests-cpu",
    "checks.doctests",
    "packages.kiln",
    "checks.ptxas",
    "checks.reproducible",
];

/// Folders a sandboxed build sees besides the store: the host's tools and
/// what they read (Debian's alternatives, the loader's cache, certificates).
const SANDBOX_PATHS: [&str; 8] = [
    "/usr",
    "/bin",
    "/lib",
    "/lib64",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ssl",
    "/etc/ca-certificates",
];

pub struct Options {
    pub sandbox: bool,
    /// A command to run in the entered dev shell instead of building.
    pub shell: Option<String>,
    pub attributes: Vec<String>,
}

/// The host's tools the package set takes (found by the caller).
pub struct Host {
    pub bash: PathBuf,
    /// rustc's sysroot, the real folder (not a link to it).
    pub rust_toolchain: PathBuf,
    pub rust_version: String,
    pub cargo_nextest: PathBuf,
    pub nixpkgs_fmt: PathBuf,
    pub deadnix: PathBuf,
    /// The folder that holds libclang.
    pub libclang: PathBuf,
}

/// The host's programs that nix-build runs or that the host package set
/// (nix/build/host-nixpkgs.nix) links from `/usr/bin`: the caller checks for
/// them all up front.
pub const HOST_PROGRAMS: [&str; 15] = [
    "nix-build",
    "nix-instantiate",
    "nix-store",
    "nix-shell",
    "cc",
    "c++",
    "jq",
    "zstd",
    "rsync",
    "unzip",
    "patchelf",
    "pkg-config",
    "curl",
    "git",
    "python3",
];

fn path_text(path: &Path) -> Result<&str> {
    path.to_str()
        .ok_or_else(|| anyhow!("{} is not UTF-8", path.display()))
}

/// `nix-build`'s arguments for the driver, for one attribute.
fn driver_args(
    root: &Path,
    checkout: &Path,
    inputs: &Inputs,
    host: &Host,
    system: &str,
) -> Result<Vec<String>> {
    let driver = root.join("nix/build/default.nix");
    let mut args = vec![path_text(&driver)?.to_string()];
    for (name, path) in [
        ("repo", checkout),
        ("nixpkgsLib", &inputs.nixpkgs_lib),
        ("crane", &inputs.crane),
        ("rustOverlay", &inputs.rust_overlay),
    ] {
        args.extend(["--arg".into(), name.into(), nix_path(path)?]);
    }
    for (name, value) in [
        ("system", system.to_string()),
        ("hostPath", "/usr/bin:/bin".to_string()),
        ("hostBash", path_text(&host.bash)?.to_string()),
        (
            "hostCertificates",
            "/etc/ssl/certs/ca-certificates.crt".to_string(),
        ),
        (
            "rustToolchain",
            path_text(&host.rust_toolchain)?.to_string(),
        ),
        ("rustVersion", host.rust_version.clone()),
        ("cargoNextest", path_text(&host.cargo_nextest)?.to_string()),
        ("nixpkgsFmt", path_text(&host.nixpkgs_fmt)?.to_string()),
        ("deadnix", path_text(&host.deadnix)?.to_string()),
        ("libclang", path_text(&host.libclang)?.to_string()),
    ] {
        args.extend(["--argstr".into(), name.into(), value]);
    }
    Ok(args)
}

fn nix_options(sandbox: bool) -> Vec<String> {
    let mut options = vec![
        // No binary cache: everything is built here (and cache.nixos.org is
        // out of reach).
        "--option".to_string(),
        "substituters".to_string(),
        String::new(),
        "--option".to_string(),
        "sandbox".to_string(),
        sandbox.to_string(),
        "--cores".to_string(),
        "0".to_string(),
        "--max-jobs".to_string(),
        "1".to_string(),
    ];
    // Single-user, as root: Nix builds as an unprivileged user of its own
    // user namespace, with or without the sandbox; no nixbld users needed.
    options.extend([
        "--option".to_string(),
        "build-users-group".to_string(),
        String::new(),
    ]);
    if sandbox {
        options.extend([
            "--option".to_string(),
            "extra-sandbox-paths".to_string(),
            SANDBOX_PATHS.join(" "),
        ]);
    }
    options
}

/// The negative control of `--sandbox`: a derivation (new every run, so
/// never reused) that tries to reach a package registry must find no network,
/// with the options every build here gets.
fn sandbox_has_no_network() -> Result<()> {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let expression = format!(
        r#"derivation {{ name = "kiln-sandbox-control"; system = builtins.currentSystem; builder = "/bin/sh"; nonce = "{nonce}";
            args = [ "-c" "PATH=/usr/bin:/bin; if curl --silent --max-time 10 --output /dev/null https://pypi.org/simple/; then echo reached > $out; else echo isolated > $out; fi" ]; }}"#
    );
    let out = read(
        Command::new("nix-build")
            .args(["--no-out-link", "-E", &expression])
            .args(nix_options(true)),
    )?;
    let verdict = std::fs::read_to_string(out.lines().last().unwrap_or_default())?;
    if verdict.trim() != "isolated" {
        return Err(anyhow!(
            "a sandboxed build reached https://pypi.org: Nix's sandbox is not on here (nix-build --option sandbox true)"
        ));
    }
    eprintln!("nix-build: the sandbox's control derivation found no network (as it must)");
    Ok(())
}

/// Whether every output of `attribute`'s derivation is already in the store.
fn in_store(base: &[String], attribute: &str) -> Result<bool> {
    let drv = read(Command::new("nix-instantiate").args(base).args([
        "-A",
        attribute,
        "--option",
        "build-users-group",
        "",
    ]))?;
    let outputs = read(Command::new("nix-store").args(["--query", "--outputs", &drv]))?;
    Ok(outputs.lines().all(|o| Path::new(o).exists()))
}

/// Builds `options.attributes` (default: [`ALL`]) of the flake at
/// `checkout` for `system`, or enters its dev shell.
pub fn run(
    checkout: &Checkout,
    inputs: &Inputs,
    host: &Host,
    system: &str,
    options: Options,
) -> Result<()> {
    // The tracked files only, as a flake sees its source.
    let work = tempfile::tempdir().context("cannot create a scratch folder")?;
    let copy = work.path().join("kiln");
    checkout.copy_to(&copy)?;
    let base = driver_args(checkout.root, &copy, inputs, host, system)?;
    if let Some(command) = options.shell {
        return enter_shell(checkout.root, &base, &command, &host.bash, work.path());
    }
    let attributes = if options.attributes.is_empty() {
        ALL.iter().map(|a| a.to_string()).collect()
    } else {
        options.attributes
    };
    eprintln!(
        "nix-build: {} outputs for {system}, {}; rust {} from {}",
        attributes.len(),
        if options.sandbox {
            "sandboxed"
        } else {
            "unsandboxed"
        },
        host.rust_version,
        host.rust_toolchain.display()
    );
    if options.sandbox {
        sandbox_has_no_network()?;
    }
    let mut failed = Vec::new();
    for attribute in &attributes {
        let started = Instant::now();
        // An output that does not evaluate fails at nix-build, which says why.
        let reused = in_store(&base, attribute).unwrap_or(false);
        let status = status(
            Command::new("nix-build")
                .args(&base)
                .args(["-A", attribute, "--no-out-link"])
                .args(nix_options(options.sandbox)),
        )?;
        let seconds = started.elapsed().as_secs_f64();
        let verdict = match (status.success(), reused) {
            (true, true) => "reused (already in the store)",
            (true, false) => "built",
            (false, _) => "FAILED",
        };
        eprintln!("nix-build {attribute}: {verdict} in {seconds:.1} s");
        if !status.success() {
            failed.push(attribute.clone());
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(anyhow!("nix-build failed: {}", failed.join(", ")))
    }
}

/// Enters `devShells.default` as a contributor would (`nix-shell` on its
/// derivation: Debian's Nix 2.8 has no `nix develop` for a flake it cannot
/// fetch), pure, and runs `command` in it from the checkout.
fn enter_shell(
    root: &Path,
    base: &[String],
    command: &str,
    bash: &Path,
    scratch: &Path,
) -> Result<()> {
    eprintln!(
        "nix-shell devShells.default (pure), in {}: {command}",
        root.display()
    );
    // nix-shell puts its shell's folder first on PATH: the host's bash, in a
    // folder of its own (without it nix-shell looks for <nixpkgs>, fails,
    // takes `bash` from PATH and puts `.` first).
    let shell_bin = scratch.join("shell-bin");
    std::fs::create_dir_all(&shell_bin)?;
    std::os::unix::fs::symlink(bash, shell_bin.join("bash"))?;
    let started = Instant::now();
    let status = status(
        Command::new("nix-shell")
            .env("NIX_BUILD_SHELL", shell_bin.join("bash"))
            .args(base)
            .args(["-A", "devShells.default", "--pure"])
            // HOME for cargo's registry cache; TERM for its progress bars.
            .args(["--keep", "HOME", "--keep", "TERM"])
            .args(nix_options(false))
            .args(["--run", command])
            .current_dir(root),
    )?;
    let seconds = started.elapsed().as_secs_f64();
    match status.success() {
        true => {
            eprintln!("nix-shell: the command passed in the dev shell in {seconds:.1} s");
            Ok(())
        }
        false => Err(anyhow!("in the dev shell, `{command}` failed ({status})")),
    }
}
