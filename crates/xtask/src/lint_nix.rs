//! `cargo xtask lint-nix`: every Nix file parses (`nix-instantiate --parse`),
//! is formatted (`nixpkgs-fmt --check`, the flake's formatter) and has no dead
//! code (`deadnix --fail`). Parsing comes first: the other two pass files
//! with syntax errors.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, anyhow};

use crate::pins::repo_root;
use crate::setup::Toolbox;
use crate::tools::require_host_program;
use crate::tree::source_files;

pub fn run(tools: &Toolbox) -> Result<()> {
    let root = repo_root();
    let files: Vec<PathBuf> = source_files(&root)?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "nix"))
        .collect();
    if files.is_empty() {
        return Err(anyhow!("no .nix files in {}", root.display()));
    }
    require_host_program("nix-instantiate", "parses the Nix files")?;
    let nixpkgs_fmt = tools.find("nixpkgs-fmt", "the flake's formatter")?;
    let deadnix = tools.find("deadnix", "finds dead Nix code")?;
    let mut failures = Vec::new();
    for file in &files {
        let output = crate::process::output(
            Command::new("nix-instantiate")
                .arg("--parse")
                .arg(file)
                .current_dir(&root),
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
        for (program, args) in [(&nixpkgs_fmt, ["--check"]), (&deadnix, ["--fail"])] {
            let output = crate::process::output(
                Command::new(program)
                    .args(args)
                    .args(&files)
                    .current_dir(&root),
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
