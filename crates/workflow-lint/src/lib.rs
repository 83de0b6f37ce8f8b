//! `cargo xtask lint-workflows`: `.github/` passes zizmor (offline, auditor
//! persona: every audit at every confidence, workflows and the Dependabot
//! file, configured by `.github/zizmor.yml`), keeps the invariants zizmor
//! cannot express ([`invariants`]), and passes actionlint (with its
//! shellcheck and pyflakes rules, which it would otherwise skip in silence
//! when those programs are missing), with zero findings; a finding can only
//! be silenced inline, with its reason.
//!
//! The caller says where the programs are (xtask: the hash-pinned ones
//! `cargo xtask setup` installs, else PATH); this crate knows nothing of
//! how they were installed.

pub mod invariants;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, anyhow};

/// zizmor's arguments, run from the repository's root.
const ZIZMOR_ARGS: [&str; 6] = [
    "--offline",
    "--persona",
    "auditor",
    "--config",
    ".github/zizmor.yml",
    ".github",
];

/// Finds a program the lint runs, from its name and what it is for; an
/// error says how to install it.
pub type FindProgram<'a> = &'a dyn Fn(&str, &str) -> Result<PathBuf>;

/// Lints the `.github/` of the repository at `root`; fails naming every
/// check that found something. A missing program stops it before any runs.
pub fn run(root: &Path, find: FindProgram) -> Result<()> {
    let mut failures = Vec::new();

    let findings = invariants::check_repository(root)?;
    println!("$ workflow invariants (crates/workflow-lint/src/invariants.rs)");
    for finding in &findings {
        println!("{finding}");
    }
    if !findings.is_empty() {
        failures.push("invariants");
    }

    let purpose = "lints the GitHub workflows";
    let actionlint = find("actionlint", purpose)?;
    let zizmor = find("zizmor", purpose)?;
    let shellcheck = find("shellcheck", "actionlint's check of `run:` scripts")?;
    let pyflakes = find("pyflakes", "actionlint's check of Python steps")?;
    for helper in [&shellcheck, &pyflakes] {
        println!("{}: {}", helper.display(), version_line(helper)?);
    }
    let checks = [
        (
            "actionlint",
            actionlint.as_path(),
            vec![
                format!("-shellcheck={}", shellcheck.display()),
                format!("-pyflakes={}", pyflakes.display()),
            ],
        ),
        (
            "zizmor",
            zizmor.as_path(),
            ZIZMOR_ARGS.map(String::from).to_vec(),
        ),
    ];
    for (name, program, args) in &checks {
        let version = version_line(program)?;
        let out = output(Command::new(program).args(args).current_dir(root))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        println!(
            "$ {} {}   ({version})\n{}",
            program.display(),
            args.join(" "),
            text.trim_end()
        );
        if !out.status.success() {
            failures.push(name);
        }
    }
    if !failures.is_empty() {
        return Err(anyhow!("workflow lint failed: {}", failures.join(", ")));
    }
    println!(
        "workflows: zizmor reports no findings, the invariants hold, actionlint (with shellcheck, pyflakes) reports none"
    );
    Ok(())
}

/// Runs a program with its output captured; the caller judges the status.
fn output(command: &mut Command) -> Result<Output> {
    command
        .output()
        .with_context(|| format!("cannot run {:?}", command.get_program()))
}

fn version_line(program: &Path) -> Result<String> {
    let out = output(Command::new(program).arg("--version"))?;
    if !out.status.success() {
        return Err(anyhow!(
            "`{} --version` failed ({}): {}",
            program.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // The first line that holds a number (shellcheck prints its name first).
    let line = text
        .lines()
        .find(|l| l.chars().any(|c| c.is_ascii_digit()))
        .or_else(|| text.lines().next());
    Ok(line.unwrap_or_default().trim().to_string())
}

/// The repository root (this crate lives in `crates/workflow-lint`).
#[cfg(test)]
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/workflow-lint has two parents")
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::invariants::Rule;

    /// actionlint skips its shellcheck and pyflakes rules in silence when
    /// those programs are missing; lint-workflows must stop instead.
    #[test]
    fn a_missing_shellcheck_or_pyflakes_fails_the_lint() {
        for missing in ["shellcheck", "pyflakes"] {
            let bin = tempfile::tempdir().unwrap();
            for program in ["actionlint", "zizmor", "shellcheck", "pyflakes"] {
                if program == missing {
                    continue;
                }
                // Stand-ins that would pass: the lint must not get that far.
                let path = bin.path().join(program);
                std::fs::write(&path, "#!/bin/sh\necho stand-in\n").unwrap();
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            // The caller's finder: its error is what the lint must stop
            // with (xtask's names `cargo xtask setup`; its own test says so).
            let find = |program: &str, purpose: &str| {
                let path = bin.path().join(program);
                path.is_file()
                    .then_some(path)
                    .ok_or_else(|| anyhow!("`{program}` ({purpose}) is not installed"))
            };
            let error = run(&repo_root(), &find).unwrap_err().to_string();
            assert!(error.contains(&format!("`{missing}`")), "{error}");
        }
    }

    /// Which check must catch a deleted guard.
    enum Catcher {
        /// One of kiln's invariants.
        Rust(Rule),
        /// A zizmor audit, by its id.
        Zizmor(&'static str),
    }
    use Catcher::{Rust, Zizmor};

    const CI: &str = ".github/workflows/ci.yml";
    const GPU: &str = ".github/workflows/gpu.yml";
    const BOT: &str = ".github/dependabot.yml";
    const CHECKOUT: &str = "actions/checkout@3d3c42e5aac5ba805825da76410c181273ba90b1";
    const CACHE_WRITE_IF: &str =
        "if: github.event_name == 'push' && github.ref == 'refs/heads/main'";
    const GPU_IF: &str = "if: vars.KILN_GPU_RUNNER == 'true' && github.ref == 'refs/heads/main'";

    /// A guard deleted: the file, its edits (from, to), the check that must
    /// catch it.
    type Deletion = (
        &'static str,
        &'static [(&'static str, &'static str)],
        Catcher,
    );

    /// Every guard of `.github/` deleted, one at a time: the file, its edits
    /// (from, to; `{CHECKOUT}`, `{CACHE_WRITE_IF}` and `{GPU_IF}` stand for
    /// those texts), and the check that must catch it.
    #[rustfmt::skip]
    const DELETIONS: &[Deletion] = &[
        // Triggers that run with secrets on what a pull request controls.
        (CI, &[("  pull_request:\n", "  pull_request:\n  pull_request_target:\n")], Zizmor("dangerous-triggers")),
        (CI, &[("  pull_request:\n", "  pull_request:\n  workflow_run:\n")], Zizmor("dangerous-triggers")),
        (CI, &[("  pull_request:\n", ""), ("  push:\n    branches: [main]\n", ""), ("on:\n", "on: [push, workflow_run]\n")], Zizmor("dangerous-triggers")),
        // Read-only permissions, at the top and in every job.
        (CI, &[("permissions:\n  contents: read\n", "")], Zizmor("excessive-permissions")),
        (CI, &[("  contents: read\n", "  contents: write\n")], Zizmor("excessive-permissions")),
        (GPU, &[("permissions:\n  contents: read\n", "permissions: write-all\n")], Zizmor("excessive-permissions")),
        (CI, &[("    needs: nix-flake-check\n", "    needs: nix-flake-check\n    permissions:\n      id-token: write\n")], Zizmor("undocumented-permissions")),
        // A write with a comment passes zizmor; the Rust half refuses any.
        (CI, &[("    needs: nix-flake-check\n", "    needs: nix-flake-check\n    permissions:\n      id-token: write # OIDC for the cache\n")], Rust(Rule::WritePermission)),
        (CI, &[("  contents: read\n", "  contents: write # releases\n")], Rust(Rule::WritePermission)),
        (GPU, &[("    timeout-minutes: 60\n", "    timeout-minutes: 60\n    permissions: write-all\n")], Zizmor("excessive-permissions")),
        // Actions at a full SHA with its tag; images at a digest.
        (GPU, &[("{CHECKOUT}", "actions/checkout@v7.0.1")], Zizmor("unpinned-uses")),
        (GPU, &[("{CHECKOUT}", "actions/checkout@3d3c42e")], Zizmor("unpinned-uses")),
        (GPU, &[(" # v7.0.1\n", "\n")], Rust(Rule::ActionTag)),
        (GPU, &[("- uses: {CHECKOUT} # v7.0.1\n        with:\n          persist-credentials: false\n", "- uses: docker://alpine:3\n")], Zizmor("unpinned-images")),
        // No token left in .git/config.
        (GPU, &[("        with:\n          persist-credentials: false\n", "")], Zizmor("artipacked")),
        (GPU, &[("persist-credentials: false", "persist-credentials: true")], Zizmor("artipacked")),
        // Values reach scripts through env:, never spliced into them.
        (CI, &[("\".#devShells.$SYSTEM.default\"", "\".#devShells.${{ matrix.system }}.default\"")], Zizmor("template-injection")),
        (GPU, &[("          nix develop --command cargo run", "          echo \"${{ github.event.head_commit.message }}\"\n          nix develop --command cargo run")], Zizmor("template-injection")),
        // A stale Cargo.lock fails instead of being rewritten.
        (GPU, &[("cargo test --locked --release", "cargo test --release")], Rust(Rule::CargoUnlocked)),
        (GPU, &[("cargo run --locked --release", "cargo run --release")], Rust(Rule::CargoUnlocked)),
        // The self-hosted runner: pushes to main and manual runs on main
        // only. A pull_request trigger on the GPU workflow: its `if:` no
        // longer protects anything, since the pull request brings its own copy.
        (GPU, &[("on:\n", "on:\n  pull_request:\n")], Rust(Rule::SelfHostedRunner)),
        (GPU, &[("{GPU_IF}", "if: vars.KILN_GPU_RUNNER == 'true'")], Rust(Rule::SelfHostedRunner)),
        (GPU, &[("    {GPU_IF}\n", "")], Rust(Rule::SelfHostedRunner)),
        (GPU, &[("github.ref == 'refs/heads/main'", "github.ref == 'refs/heads/main' || github.event_name == 'push'")], Rust(Rule::SelfHostedRunner)),
        // A self-hosted runner in a workflow that pull requests trigger.
        (CI, &[("runner: ubuntu-24.04-arm", "runner: self-hosted")], Rust(Rule::SelfHostedRunner)),
        (CI, &[("    runs-on: ubuntu-24.04\n", "    runs-on: [self-hosted, linux, gpu]\n")], Rust(Rule::SelfHostedRunner)),
        // Secrets and the write environment: pushes to main only.
        (CI, &[("    {CACHE_WRITE_IF}\n", "")], Rust(Rule::SecretOffMain)),
        (CI, &[("{CACHE_WRITE_IF}", "if: github.ref == 'refs/heads/main'")], Rust(Rule::SecretOffMain)),
        (CI, &[("{CACHE_WRITE_IF}", "if: github.event_name == 'push'")], Rust(Rule::SecretOffMain)),
        // The token moved into a job that pull requests run, or to the top.
        (CI, &[("          skipPush: true\n", "          authToken: ${{ secrets.CACHIX_AUTH_TOKEN }}\n")], Rust(Rule::SecretOffMain)),
        (CI, &[("concurrency:\n", "env:\n  TOKEN: ${{ secrets.CACHIX_AUTH_TOKEN }}\nconcurrency:\n")], Rust(Rule::SecretOffMain)),
        // Every other way to read the secrets context.
        (CI, &[("      - name: .ci/run\n", "      - name: .ci/run\n        env:\n          T: ${{ secrets['CACHIX_AUTH_TOKEN'] }}\n")], Rust(Rule::SecretOffMain)),
        (CI, &[("      - name: .ci/run\n", "      - name: .ci/run\n        env:\n          T: ${{ toJSON(secrets) }}\n")], Rust(Rule::SecretOffMain)),
        (CI, &[("    timeout-minutes: 90\n", "    timeout-minutes: 90\n    environment: cachix-write\n")], Rust(Rule::SecretOffMain)),
        (CI, &[("          cachixBin: ${{ runner.temp }}/cachix/bin/cachix\n", "")], Rust(Rule::CachixCli)),
        // Dependabot keeps the SHAs current, a week behind.
        (BOT, &[("    cooldown:\n      default-days: 7\n", "")], Zizmor("dependabot-cooldown")),
        (BOT, &[("default-days: 7", "default-days: 2")], Zizmor("dependabot-cooldown")),
        (BOT, &[("package-ecosystem: github-actions", "package-ecosystem: cargo")], Rust(Rule::Dependabot)),
    ];

    /// An edit's text with the table's placeholders filled in.
    fn expand(text: &str) -> String {
        text.replace("{CHECKOUT}", CHECKOUT)
            .replace("{CACHE_WRITE_IF}", CACHE_WRITE_IF)
            .replace("{GPU_IF}", GPU_IF)
    }

    /// zizmor as `KILN_ZIZMOR` names it (`cargo xtask test` passes the one
    /// `cargo xtask setup` installed) or on PATH; `None` elsewhere (Nix's
    /// build sandbox), where only the Rust invariants' half runs.
    fn zizmor() -> Option<PathBuf> {
        if let Some(path) = std::env::var_os("KILN_ZIZMOR") {
            return Some(PathBuf::from(path));
        }
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|dir| dir.join("zizmor"))
            .find(|path| path.is_file())
    }

    /// Copies the folder `from` to `to`, every copy writable (the source
    /// may come read-only from the Nix store).
    fn copy_tree(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let target = to.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                copy_tree(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), &target).unwrap();
                let mut permissions = std::fs::metadata(&target).unwrap().permissions();
                permissions.set_mode(permissions.mode() | 0o200);
                std::fs::set_permissions(&target, permissions).unwrap();
            }
        }
    }

    /// The audits zizmor reports for the repository at `root`.
    fn zizmor_audits(zizmor: &Path, root: &Path) -> Vec<String> {
        let out = output(
            Command::new(zizmor)
                .args(ZIZMOR_ARGS)
                .args(["--format", "json"])
                .current_dir(root),
        )
        .unwrap();
        let findings: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("zizmor printed no JSON ({e}): {out:?}"));
        findings
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["ignored"] != true)
            .map(|f| f["ident"].as_str().unwrap().to_string())
            .collect()
    }

    /// Each guard deleted from a copy of `.github` is caught by the check
    /// the table names, and the unedited copy passes both: the lint's two
    /// halves together still catch every deletion the invariants once did
    /// alone.
    #[test]
    fn every_guard_deletion_fails_the_lint() {
        let zizmor = zizmor();
        if zizmor.is_none() {
            println!(
                "skipped zizmor's half: no zizmor (KILN_ZIZMOR, PATH; `cargo xtask test` passes the one `cargo xtask setup` installs); only the Rust invariants' deletions run"
            );
        }
        let copy = tempfile::tempdir().unwrap();
        let root = copy.path();
        let github = root.join(".github");
        copy_tree(&repo_root().join(".github"), &github);
        if let Some(zizmor) = &zizmor {
            assert_eq!(zizmor_audits(zizmor, root), Vec::<String>::new());
        }
        assert!(invariants::check_repository(root).unwrap().is_empty());
        for (file, edits, catcher) in DELETIONS {
            let original = std::fs::read_to_string(repo_root().join(file)).unwrap();
            let mut text = original.clone();
            for (from, to) in *edits {
                let from = expand(from);
                // An edit that no longer applies must not pass as caught.
                assert!(text.contains(&from), "{file} no longer contains {from:?}");
                text = text.replacen(&from, &expand(to), 1);
            }
            std::fs::write(root.join(file), &text).unwrap();
            let (wanted, found) = match catcher {
                Rust(rule) => {
                    let findings = invariants::check_repository(root).unwrap();
                    let found = findings.iter().map(|f| f.rule.name().to_string()).collect();
                    (rule.name(), found)
                }
                Zizmor(audit) => match &zizmor {
                    Some(zizmor) => (*audit, zizmor_audits(zizmor, root)),
                    None => (*audit, vec![audit.to_string()]),
                },
            };
            assert!(
                found.iter().any(|f| f == wanted),
                "{file} with {edits:?}: expected {wanted}, found {found:?}"
            );
            std::fs::write(root.join(file), original).unwrap();
        }
    }
}
