//! `cargo xtask lint-workflows`: the GitHub workflows pass actionlint and
//! zizmor (offline, auditor persona: every audit at every confidence), with
//! zero findings; a finding can only be silenced inline, with its reason.

use std::process::Command;

use anyhow::{Result, anyhow};

use crate::pins::repo_root;
use crate::tools::require_host_program;

const INSTALL: &str = "pip install --require-hashes -r .ci/requirements-lint.txt";

pub fn run() -> Result<()> {
    let root = repo_root();
    let mut failures = Vec::new();
    for (program, args) in [
        ("actionlint", vec![]),
        (
            "zizmor",
            vec!["--offline", "--persona", "auditor", ".github/workflows"],
        ),
    ] {
        let version = require_host_program(program, "lints the GitHub workflows", INSTALL)?;
        let output = Command::new(program)
            .args(&args)
            .current_dir(&root)
            .output()?;
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        println!(
            "$ {program} {}   ({version})\n{}",
            args.join(" "),
            text.trim_end()
        );
        if !output.status.success() {
            failures.push(program);
        }
    }
    if !failures.is_empty() {
        return Err(anyhow!("workflow lint failed: {}", failures.join(", ")));
    }
    println!("workflows: actionlint and zizmor report no findings");
    Ok(())
}
