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

use crate::cache::Cache;
use crate::eval_nix::{self, inputs::Inputs};
use crate::pins::repo_root;
use crate::setup::Toolbox;

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

pub struct Options<'a> {
    pub inputs: Option<&'a Path>,
    pub sandbox: bool,
    /// A command to run in the entered dev shell instead of building.
    pub shell: Option<String>,
    pub attributes: Vec<String>,
}

/// The host's tools the package set takes, found here.
struct Host {
    bash: PathBuf,
    rust_toolchain: PathBuf,
    rust_version: String,
    cargo_nextest: PathBuf,
    nixpkgs_fmt: PathBuf,
    deadnix: PathBuf,
    libclang: PathBuf,
}

/// The host's programs that nix-build runs or that the host package set
/// (nix/build/host-nixpkgs.nix) links from `/usr/bin`: all checked up front.
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

fn find_host(cache: &Cache) -> Result<Host> {
    // Every missing program named at once, so that one install fixes it.
    crate::tools::require_host_programs(&HOST_PROGRAMS, "the Nix build's host package set")?;
    let sysroot = output(Command::new("rustc").args(["--print", "sysroot"]))?;
    let version_line = output(Command::new("rustc").arg("--version"))?;
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
    .ok_or_else(|| {
        anyhow!(
            "no libclang found; {}",
            crate::tools::package_hint("libclang-dev")
        )
    })?;
    let toolbox = Toolbox::installed(cache)?;
    Ok(Host {
        bash: std::fs::canonicalize("/bin/bash")?,
        // rustup's `1.95.0` is often a link to `stable`: the store copy is
        // of the real folder.
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

fn output(command: &mut Command) -> Result<String> {
    let out = command
        .output()
        .with_context(|| format!("cannot run {command:?}"))?;
    if !out.status.success() {
        return Err(anyhow!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn path_text(path: &Path) -> Result<&str> {
    path.to_str()
        .ok_or_else(|| anyhow!("{} is not UTF-8", path.display()))
}

/// `nix-build`'s arguments for the driver, for one attribute.
fn driver_args(checkout: &Path, inputs: &Inputs, host: &Host, system: &str) -> Result<Vec<String>> {
    let driver = repo_root().join("nix/build/default.nix");
    let mut args = vec![path_text(&driver)?.to_string()];
    for (name, path) in [
        ("repo", checkout),
        ("nixpkgsLib", &inputs.nixpkgs_lib),
        ("crane", &inputs.crane),
        ("rustOverlay", &inputs.rust_overlay),
    ] {
        args.extend(["--arg".into(), name.into(), eval_nix::nix_path(path)?]);
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
    let out = output(
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
    let drv = output(Command::new("nix-instantiate").args(base).args([
        "-A",
        attribute,
        "--option",
        "build-users-group",
        "",
    ]))?;
    let outputs = output(Command::new("nix-store").args(["--query", "--outputs", &drv]))?;
    Ok(outputs.lines().all(|o| Path::new(o).exists()))
}

pub fn run(cache: &Cache, options: Options) -> Result<()> {
    let host = find_host(cache)?;
    let inputs = match options.inputs {
        Some(dir) => eval_nix::inputs::from_folder(dir)?,
        None => eval_nix::inputs::download(cache)?,
    };
    let system = crate::pins::host_system()?;
    // The tracked files only, as a flake sees its source.
    let work = tempfile::tempdir().context("cannot create a scratch folder")?;
    let checkout = work.path().join("kiln");
    crate::tree::copy_checkout(&repo_root(), &checkout)?;
    let base = driver_args(&checkout, &inputs, &host, &system)?;
    if let Some(command) = options.shell {
        return enter_shell(&base, &command, &host.bash, work.path());
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
        let status = Command::new("nix-build")
            .args(&base)
            .args(["-A", attribute, "--no-out-link"])
            .args(nix_options(options.sandbox))
            .status()
            .context("cannot run nix-build")?;
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
fn enter_shell(base: &[String], command: &str, bash: &Path, scratch: &Path) -> Result<()> {
    eprintln!(
        "nix-shell devShells.default (pure), in {}: {command}",
        repo_root().display()
    );
    // nix-shell puts its shell's folder first on PATH: the host's bash, in a
    // folder of its own (without it nix-shell looks for <nixpkgs>, fails,
    // takes `bash` from PATH and puts `.` first).
    let shell_bin = scratch.join("shell-bin");
    std::fs::create_dir_all(&shell_bin)?;
    std::os::unix::fs::symlink(bash, shell_bin.join("bash"))?;
    let started = Instant::now();
    let status = Command::new("nix-shell")
        .env("NIX_BUILD_SHELL", shell_bin.join("bash"))
        .args(base)
        .args(["-A", "devShells.default", "--pure"])
        // HOME for cargo's registry cache; TERM for its progress bars.
        .args(["--keep", "HOME", "--keep", "TERM"])
        .args(nix_options(false))
        .args(["--run", command])
        .current_dir(repo_root())
        .status()
        .context("cannot run nix-shell")?;
    let seconds = started.elapsed().as_secs_f64();
    match status.success() {
        true => {
            eprintln!("nix-shell: the command passed in the dev shell in {seconds:.1} s");
            Ok(())
        }
        false => Err(anyhow!("in the dev shell, `{command}` failed ({status})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every check the flake has for x86_64-linux (as evaluated into the
    /// committed summary) and every IREE and kiln package is built.
    #[test]
    fn every_check_and_package_is_built() {
        let Some(summary) = crate::flake_contract::summary() else {
            return;
        };
        let outputs = summary["systems"]["x86_64-linux"].as_object().unwrap();
        let wanted: Vec<&String> = outputs
            .keys()
            .filter(|k| {
                k.starts_with("checks.")
                    || (k.starts_with("packages.")
                        && (k.contains("iree") || k.as_str() == "packages.kiln"))
            })
            .collect();
        assert!(wanted.len() >= 14, "the summary lists {wanted:?}");
        let missing: Vec<&&String> = wanted
            .iter()
            .filter(|k| !ALL.contains(&k.as_str()))
            .collect();
        assert!(missing.is_empty(), "nix-build does not build {missing:?}");
    }

    /// nix/build/setup.sh run as Nix would run it, without Nix: the phases in
    /// order, a setup hook's hooks after the phase's own, a replaced phase,
    /// a source folder unpacked, patched and installed.
    #[test]
    fn the_setup_script_runs_phases_and_hooks_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let src = root.join("kiln-src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("greeting"), "hello\n").unwrap();
        std::fs::write(
            root.join("fix.patch"),
            "--- a/greeting\n+++ b/greeting\n@@ -1 +1 @@\n-hello\n+hello, patched\n",
        )
        .unwrap();
        let hook_package = root.join("hook");
        std::fs::create_dir_all(hook_package.join("nix-support")).unwrap();
        std::fs::write(
            hook_package.join("nix-support/setup-hook"),
            "fromHook() { echo hook-postPatch >> \"$TMPDIR/log\"; }\npostPatchHooks+=(fromHook)\n",
        )
        .unwrap();
        let out = root.join("out");
        let tmp = root.join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let status = Command::new("bash")
            .arg("-e")
            .arg(repo_root().join("nix/build/setup.sh"))
            .env_clear()
            // This process's PATH: under Nix, the tests' own tools.
            .env("initialPath", std::env::var_os("PATH").unwrap())
            .env("TMPDIR", &tmp)
            .env("out", &out)
            .env("src", &src)
            .env("patches", root.join("fix.patch"))
            .env("nativeBuildInputs", &hook_package)
            .env("postPatch", "echo own-postPatch >> \"$TMPDIR/log\"")
            .env(
                "buildPhase",
                "runHook preBuild; echo build >> \"$TMPDIR/log\"; runHook postBuild",
            )
            .env("installPhase", "mkdir -p $out; cp greeting $out/")
            .env("doCheck", "")
            .env("checkPhase", "echo check-must-not-run >> \"$TMPDIR/log\"")
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(
            std::fs::read_to_string(out.join("greeting")).unwrap(),
            "hello, patched\n"
        );
        assert_eq!(
            std::fs::read_to_string(tmp.join("log")).unwrap(),
            "own-postPatch\nhook-postPatch\nbuild\n"
        );
    }
}
