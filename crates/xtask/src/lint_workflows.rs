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
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text.lines().next().unwrap_or_default().to_string())
}
