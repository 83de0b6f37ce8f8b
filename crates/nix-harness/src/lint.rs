//! `cargo xtask lint-nix`: every Nix file parses (`nix-instantiate --parse`),
//! is formatted (`nixpkgs-fmt --check`, the flake's formatter) and has no dead
//! code (`deadnix --fail`): the `nix-lint` check's two linters (the same the
//! caller gives [`crate::build::Host`]), and the parse they lack. Parsing
//! comes first: the other two pass files with syntax errors.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, anyhow};

use crate::output;

/// Lints `files` (relative to `root`, where the programs run) with
/// `nix-instantiate` from PATH and the two linters the caller found.
pub fn run(root: &Path, files: &[PathBuf], nixpkgs_fmt: &Path, deadnix: &Path) -> Result<()> {
    if files.is_empty() {
        return Err(anyhow!("no .nix files in {}", root.display()));
    }
    let mut failures = Vec::new();
    for file in files {
        let output = output(
            Command::new("nix-instantiate")
                .arg("--parse")
                .arg(file)
                .current_dir(root),
        )?;
        if !output.status.success() {
            failures.push(format!(
                "{} does not parse:\n{}",
                file.display(),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    if failures.is_empty() {
        for (program, args) in [(nixpkgs_fmt, ["--check"]), (deadnix, ["--fail"])] {
            let output = output(
                Command::new(program)
                    .args(args)
                    .args(files)
                    .current_dir(root),
            )?;
            if !output.status.success() {
                failures.push(format!(
                    "{} {}:\n{}{}",
                    program.display(),
                    args.join(" "),
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
        }
    }
    if !failures.is_empty() {
        return Err(anyhow!("{}", failures.join("\n")));
    }
    println!(
        "{} Nix files parse, are formatted and have no dead code",
        files.len()
    );
    Ok(())
}
