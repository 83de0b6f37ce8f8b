//! The evaluation driver (`nix/eval/default.nix`) run by `nix-instantiate`
//! on a checkout: every output's derivation or program, and the repository
//! files the evaluation read. eval.rs and its negative controls both run it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, anyhow};
use serde_json::Value;

use crate::inputs::Inputs;
use crate::output;

const DRIVER: &str = "nix/eval/default.nix";
/// How the driver reports each file it reads (`builtins.trace`).
const TRACE: &str = "trace: kiln-eval-read: ";

pub struct Evaluation {
    /// system -> output path (`packages.kiln`) -> `.drv` path or app program.
    pub outputs: BTreeMap<String, BTreeMap<String, String>>,
    /// Repository files read, relative to the checkout.
    pub read: BTreeSet<String>,
}

/// `Ok(Err(message))` when Nix rejects the flake.
pub(crate) fn evaluate_raw(
    root: &Path,
    checkout: &Path,
    inputs: &Inputs,
    only_system: Option<&str>,
) -> Result<std::result::Result<Evaluation, String>> {
    let driver = root.join(DRIVER);
    let mut command = Command::new("nix-instantiate");
    command
        .args(["--eval", "--strict", "--json", "--read-write-mode"])
        .arg(&driver)
        .args(["--arg", "repo"])
        .arg(nix_path(checkout)?)
        .args(["--arg", "nixpkgsLib"])
        .arg(nix_path(&inputs.nixpkgs_lib)?)
        .args(["--arg", "crane"])
        .arg(nix_path(&inputs.crane)?)
        .args(["--arg", "rustOverlay"])
        .arg(nix_path(&inputs.rust_overlay)?);
    if let Some(system) = only_system {
        command.args(["--argstr", "onlySystem", system]);
    }
    let output = output(&mut command)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        let message: Vec<&str> = stderr
            .lines()
            .filter(|l| !l.starts_with(TRACE) && !l.contains("build-users-group"))
            .collect();
        return Ok(Err(message.join("\n")));
    }
    let read = stderr
        .lines()
        .filter_map(|l| l.strip_prefix(TRACE))
        .map(str::to_string)
        .collect();
    let value: Value =
        serde_json::from_slice(&output.stdout).context("nix-instantiate printed no JSON")?;
    let mut outputs = BTreeMap::new();
    for (system, tree) in value
        .as_object()
        .ok_or_else(|| anyhow!("the driver returned no systems"))?
    {
        let mut flat = BTreeMap::new();
        flatten("", tree, &mut flat);
        outputs.insert(system.clone(), flat);
    }
    Ok(Ok(Evaluation { outputs, read }))
}

/// An absolute path as a Nix path literal.
pub fn nix_path(path: &Path) -> Result<String> {
    let path = std::fs::canonicalize(path)
        .with_context(|| format!("{} does not exist", path.display()))?;
    let text = path
        .to_str()
        .ok_or_else(|| anyhow!("{} is not UTF-8", path.display()))?;
    if text.contains(|c: char| c.is_whitespace() || c == '"' || c == '$') {
        return Err(anyhow!(
            "{text}: Nix path literals cannot hold spaces, quotes or `$`; use another folder"
        ));
    }
    Ok(text.to_string())
}

fn flatten(prefix: &str, value: &Value, out: &mut BTreeMap<String, String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        Value::String(s) => {
            out.insert(prefix.to_string(), s.clone());
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}
