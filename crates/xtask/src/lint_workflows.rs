//! `cargo xtask lint-workflows`: `.github/` keeps kiln's security invariants
//! (workflow_invariants.rs) and passes actionlint (with its shellcheck and
//! pyflakes rules, which it would otherwise skip in silence when those
//! programs are missing) and zizmor (offline, auditor persona: every audit at
//! every confidence, workflows and the Dependabot file), with zero findings;
//! a finding can only be silenced inline, with its reason.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, anyhow};

use crate::pins::repo_root;
use crate::setup::Toolbox;
use crate::workflow_invariants;

pub fn run(tools: &Toolbox) -> Result<()> {
    let root = repo_root();
    let mut failures = Vec::new();

    let findings = workflow_invariants::check_repository(&root)?;
    println!("$ workflow invariants (crates/xtask/src/workflow_invariants.rs)");
    for finding in &findings {
        println!("{finding}");
    }
    if !findings.is_empty() {
        failures.push("invariants");
    }

    let purpose = "lints the GitHub workflows";
    let actionlint = tools.find("actionlint", purpose)?;
    let zizmor = tools.find("zizmor", purpose)?;
    let shellcheck = tools.find("shellcheck", "actionlint's check of `run:` scripts")?;
    let pyflakes = tools.find("pyflakes", "actionlint's check of Python steps")?;
    for helper in [&shellcheck, &pyflakes] {
        println!("{}: {}", helper.display(), version_line(helper)?);
    }
    let checks = [
        (
            actionlint.as_path(),
            vec![
                format!("-shellcheck={}", shellcheck.display()),
                format!("-pyflakes={}", pyflakes.display()),
            ],
        ),
        (
            zizmor.as_path(),
            ["--offline", "--persona", "auditor", ".github"]
                .map(String::from)
                .to_vec(),
        ),
    ];
    for (program, args) in &checks {
        let version = version_line(program)?;
        let output = Command::new(program)
            .args(args)
            .current_dir(&root)
            .output()?;
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        println!(
            "$ {} {}   ({version})\n{}",
            program.display(),
            args.join(" "),
            text.trim_end()
        );
        if !output.status.success() {
            failures.push(if *program == actionlint {
                "actionlint"
            } else {
                "zizmor"
            });
        }
    }
    if !failures.is_empty() {
        return Err(anyhow!("workflow lint failed: {}", failures.join(", ")));
    }
    println!(
        "workflows: invariants hold; actionlint (with shellcheck, pyflakes) and zizmor report no findings"
    );
    Ok(())
}

fn version_line(program: &Path) -> Result<String> {
    let output = Command::new(program)
        .arg("--version")
        .output()
        .map_err(|e| anyhow!("cannot run {}: {e}", program.display()))?;
    if !output.status.success() {
        return Err(anyhow!(
            "`{} --version` failed ({})",
            program.display(),
            output.status
        ));
    }
    // The first line that holds a number (shellcheck prints its name first).
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .find(|l| l.chars().any(|c| c.is_ascii_digit()))
        .or_else(|| text.lines().next());
    Ok(line.unwrap_or_default().trim().to_string())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

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
            let tools = Toolbox::with_dirs(vec![bin.path().to_path_buf()], "");
            let error = run(&tools).unwrap_err().to_string();
            assert!(
                error.contains(&format!("`{missing}`")) && error.contains("cargo xtask setup"),
                "{error}"
            );
        }
    }
}
