//! `cargo xtask eval-nix`: every output of `flake.nix`, for every system,
//! evaluated and instantiated (`.drv` files, nothing built) with Debian's
//! Nix, real nixpkgs `lib`, real crane and rust-overlay at the locked
//! revisions and the stand-in `nix/eval/nixpkgs-stand-in.nix`. Writes
//! `nix/eval/summary.json`: per system and output the derivation, its
//! builder, inputs and environment; the outputs a Rust-only edit changes;
//! the negative controls' errors; and the sha256 of every repository file
//! the evaluation read, which `cargo xtask eval-nix --check` (a step of the
//! test suite) holds the working tree to.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use serde_json::{Value, json};

use crate::driver::evaluate_raw;
pub use crate::driver::{Evaluation, nix_path};
use crate::inputs::Inputs;
use crate::{Checkout, controls, read, sha256_file};

const SUMMARY: &str = "nix/eval/summary.json";
/// The evaluation's own files: they change what it finds, so they are
/// hashed too.
const EVALUATOR: [&str; 6] = [
    "nix/eval/default.nix",
    "nix/eval/call-flake.nix",
    "nix/eval/scope.nix",
    "nix/eval/read-as-nix-2-8.nix",
    "nix/eval/nixpkgs-stand-in.nix",
    "flake.lock",
];
/// The Rust-only edit: derivations it changes are the ones a Rust edit
/// rebuilds. None of these may be among them.
const RUST_EDIT: &str = "crates/kiln-core/src/lib.rs";
const NOT_REBUILT_BY_RUST_EDITS: [&str; 3] = [
    "packages.iree-runtime",
    "packages.iree-runtime-cuda",
    "packages.iree-compiler",
];
/// An edit to the installer the IREE derivations run.
const XTASK_EDIT: &str = "crates/xtask/src/prefix.rs";
/// Debian's Nix programs the evaluation runs: the caller checks for them
/// before it starts, naming their package.
pub const PROGRAMS: [&str; 3] = ["nix-instantiate", "nix", "nix-hash"];

/// The outputs whose `.drv` changes when a comment is appended to `file`.
fn edited_outputs(
    checkout: &Checkout,
    work: &Path,
    file: &str,
    inputs: &Inputs,
    before: &Evaluation,
) -> Result<Vec<String>> {
    let edited = work.join("kiln-edited");
    checkout.copy_to(&edited)?;
    let path = edited.join(file);
    let text = std::fs::read_to_string(&path)?;
    std::fs::write(&path, text + "\n// eval-nix: an edit\n")?;
    let after = evaluate(checkout.root, &edited, inputs, None)?;
    Ok(changed_outputs(&before.outputs, &after.outputs))
}

/// Evaluates, summarises, runs the negative controls, writes the summary
/// into the checkout.
pub fn run(checkout: &Checkout, inputs: &Inputs) -> Result<()> {
    let started = Instant::now();
    let root = checkout.root;
    let work = tempfile::tempdir().context("cannot create a scratch folder")?;
    let copy = work.path().join("kiln");
    checkout.copy_to(&copy)?;
    let evaluation = evaluate(root, &copy, inputs, None)?;
    eprintln!(
        "evaluated {} systems in {:.1}s",
        evaluation.outputs.len(),
        started.elapsed().as_secs_f64()
    );
    let systems = summarise(&evaluation.outputs)?;
    let mut problems = check_rules(&systems);
    problems.extend(coverage_rules(&systems));
    problems.extend(reproducible_rule(&evaluation.outputs)?);
    if !problems.is_empty() {
        return Err(anyhow!(
            "the flake evaluates, but:\n  {}",
            problems.join("\n  ")
        ));
    }

    // The same checkout with one comment added to a Rust source: the IREE
    // packages must not change. And with one added to xtask's installer:
    // they must (else they would not build from the real xtask).
    let rebuilt = edited_outputs(checkout, work.path(), RUST_EDIT, inputs, &evaluation)?;
    let wrongly_rebuilt: Vec<&String> = rebuilt
        .iter()
        .filter(|o| {
            NOT_REBUILT_BY_RUST_EDITS
                .iter()
                .any(|n| o.ends_with(&format!(".{n}")))
        })
        .collect();
    let xtask_rebuilt = edited_outputs(checkout, work.path(), XTASK_EDIT, inputs, &evaluation)?;
    if !xtask_rebuilt
        .iter()
        .any(|o| o.ends_with(".packages.iree-runtime"))
    {
        return Err(anyhow!(
            "an edit to {XTASK_EDIT} does not change packages.iree-runtime: the IREE build must run this checkout's xtask"
        ));
    }

    let controls = controls::run(checkout, work.path(), inputs)?;

    let mut read: BTreeMap<String, String> = BTreeMap::new();
    for file in evaluation.read.iter().map(String::as_str).chain(EVALUATOR) {
        read.insert(file.to_string(), sha256_file(&root.join(file))?);
    }
    let summary = json!({
        "_comment": "Written by `cargo xtask eval-nix`; do not edit. `read` holds the sha256 of every repository file the evaluation read; `cargo xtask eval-nix --check` (a step of `cargo xtask test`) fails when one differs.",
        "command": "cargo xtask eval-nix --inputs DIR   (DIR: nixpkgs-lib/, crane/, rust-overlay/; or no --inputs where GitHub is reachable)",
        "nix": nix_version()?,
        "inputs": inputs.provenance,
        "read": read,
        "rust_edit": {
            "edited": RUST_EDIT,
            "changed_outputs": rebuilt,
        },
        "xtask_edit": {
            "edited": XTASK_EDIT,
            "changed_outputs": xtask_rebuilt,
        },
        "negative_controls": controls,
        "systems": systems,
    });
    let path = root.join(SUMMARY);
    std::fs::write(&path, serde_json::to_string_pretty(&summary)? + "\n")?;
    eprintln!(
        "eval-nix: {} outputs instantiated, {} negative controls refused, {:.1}s; wrote {SUMMARY}",
        summary["systems"]
            .as_object()
            .map(|s| s
                .values()
                .map(|o| o.as_object().map_or(0, |o| o.len()))
                .sum::<usize>())
            .unwrap_or(0),
        summary["negative_controls"]
            .as_array()
            .map_or(0, |c| c.len()),
        started.elapsed().as_secs_f64()
    );
    if !wrongly_rebuilt.is_empty() {
        return Err(anyhow!(
            "a Rust-only edit ({RUST_EDIT}) changes {wrongly_rebuilt:?}: the IREE derivations must not depend on Rust sources"
        ));
    }
    Ok(())
}

/// Fails if a file the committed summary (in the checkout at `root`) hashed
/// has changed since.
pub fn check(root: &Path) -> Result<()> {
    let path = root.join(SUMMARY);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read {}: run `cargo xtask eval-nix` and commit it",
            path.display()
        )
    })?;
    let summary: Value = serde_json::from_str(&text)
        .with_context(|| format!("{SUMMARY} is malformed: run `cargo xtask eval-nix` again"))?;
    let read = summary["read"]
        .as_object()
        .ok_or_else(|| anyhow!("{SUMMARY} has no `read` table: run `cargo xtask eval-nix`"))?;
    let mut stale = Vec::new();
    for (file, hash) in read {
        let actual = sha256_file(&root.join(file)).unwrap_or_else(|_| "missing".into());
        if Some(actual.as_str()) != hash.as_str() {
            stale.push(file.clone());
        }
    }
    for file in EVALUATOR {
        if !read.contains_key(file) {
            stale.push(file.to_string());
        }
    }
    if !stale.is_empty() {
        return Err(anyhow!(
            "the Nix evaluation summary ({SUMMARY}) is stale: {} changed since it was made. \
             Run `cargo xtask eval-nix --inputs DIR` (see docs/nix-eval.md) and commit the summary.",
            stale.join(", ")
        ));
    }
    eprintln!("{SUMMARY} is current ({} files hashed)", read.len());
    Ok(())
}

/// Runs `root`'s driver on `checkout` (a copy of it); `only_system`
/// restricts it to one system. Returns the outputs, or the error text Nix
/// printed.
fn evaluate(
    root: &Path,
    checkout: &Path,
    inputs: &Inputs,
    only_system: Option<&str>,
) -> Result<Evaluation> {
    match evaluate_raw(root, checkout, inputs, only_system)? {
        Ok(evaluation) => Ok(evaluation),
        Err(message) => Err(anyhow!("the flake does not evaluate:\n{message}")),
    }
}

/// `system.output` of every output whose `.drv` differs.
fn changed_outputs(
    before: &BTreeMap<String, BTreeMap<String, String>>,
    after: &BTreeMap<String, BTreeMap<String, String>>,
) -> Vec<String> {
    let mut changed = Vec::new();
    for (system, outputs) in before {
        for (name, drv) in outputs {
            if after.get(system).and_then(|o| o.get(name)) != Some(drv) {
                changed.push(format!("{system}.{name}"));
            }
        }
    }
    changed
}

/// Per system and output: the derivation's name, builder, inputs and
/// environment, store hashes removed (they change with any source edit).
fn summarise(outputs: &BTreeMap<String, BTreeMap<String, String>>) -> Result<Value> {
    let drvs: BTreeSet<&String> = outputs
        .values()
        .flat_map(|o| o.values())
        .filter(|p| p.ends_with(".drv"))
        .collect();
    let shown = show_derivations(drvs.iter().map(|s| s.as_str()))?;
    let mut systems = serde_json::Map::new();
    for (system, outs) in outputs {
        let mut summary = serde_json::Map::new();
        for (name, path) in outs {
            let entry = match shown.get(path) {
                Some(drv) => describe(path, drv),
                None => json!(strip_store_hashes(path)),
            };
            summary.insert(name.clone(), entry);
        }
        systems.insert(system.clone(), Value::Object(summary));
    }
    Ok(Value::Object(systems))
}

fn show_derivations<'a>(paths: impl Iterator<Item = &'a str>) -> Result<BTreeMap<String, Value>> {
    let json = read(
        Command::new("nix")
            .args([
                "--extra-experimental-features",
                "nix-command",
                "show-derivation",
            ])
            .args(paths),
    )?;
    Ok(serde_json::from_str(&json)?)
}

/// `nix-instantiate --version`'s line, for the summary.
fn nix_version() -> Result<String> {
    let text = read(Command::new("nix-instantiate").arg("--version"))?;
    Ok(text.lines().next().unwrap_or_default().to_string())
}

/// What crane calls a check's derivation, where the check's name is not in
/// it.
const CHECK_ALIASES: [(&str, &str); 4] = [
    ("rustfmt", "fmt"),
    ("tests", "nextest"),
    ("tests-cpu", "cpu-nextest"),
    ("doctests", "doctest"),
];

/// Rules the flake's outputs keep beyond evaluating: each check's derivation
/// is named after the check (what `nix flake check -L` prints), and no check
/// stores a target folder (`doInstallCargoArtifacts`: nothing reuses it).
fn check_rules(systems: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    for (system, outputs) in systems.as_object().into_iter().flatten() {
        for (output, entry) in outputs.as_object().into_iter().flatten() {
            let Some(check) = output.strip_prefix("checks.") else {
                continue;
            };
            let drv = entry["drv"].as_str().unwrap_or_default();
            let alias = CHECK_ALIASES
                .iter()
                .find(|(name, _)| *name == check)
                .map_or(check, |(_, alias)| alias);
            if !drv.contains(&format!("-{alias}-")) && !drv.ends_with(&format!("-{alias}.drv")) {
                problems.push(format!(
                    "{system}: checks.{check} is built by a derivation named {drv}; name it after the check"
                ));
            }
            if entry["env"]["doInstallCargoArtifacts"].as_str() == Some("1") {
                problems.push(format!(
                    "{system}: checks.{check} installs its target folder (doInstallCargoArtifacts); nothing reuses it"
                ));
            }
        }
    }
    problems
}

/// The Nix tests cover what `cargo xtask test` covers: a run against the
/// CPU-only prefix, and the doctests (nextest runs none).
fn coverage_rules(systems: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    for (system, outputs) in systems.as_object().into_iter().flatten() {
        let checks: Vec<&Value> = outputs
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(name, _)| name.starts_with("checks."))
            .map(|(_, entry)| entry)
            .collect();
        let env =
            |entry: &Value, key: &str| entry["env"][key].as_str().unwrap_or_default().to_string();
        if !checks.iter().any(|c| {
            env(c, "KILN_IREE_PREFIX").ends_with("-iree-runtime-3.11.0")
                && env(c, "checkPhase").contains("nextest")
        }) {
            problems.push(format!(
                "{system}: no check runs the tests against the CPU-only IREE prefix"
            ));
        }
        if !checks
            .iter()
            .any(|c| env(c, "checkPhase").contains("test --doc"))
        {
            problems.push(format!("{system}: no check runs the doctests"));
        }
    }
    problems
}

/// `checks.reproducible` compares two builds that share nothing that could
/// hide a difference: not the dependency artifacts, not the bindgen seed,
/// not the source folder (as `cargo xtask repro` builds from two checkouts).
fn reproducible_rule(outputs: &BTreeMap<String, BTreeMap<String, String>>) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    for (system, outs) in outputs {
        let Some(check) = outs.get("checks.reproducible") else {
            problems.push(format!("{system}: no checks.reproducible"));
            continue;
        };
        let shown = show_derivations(std::iter::once(check.as_str()))?;
        let builds: Vec<String> = shown[check]["inputDrvs"]
            .as_object()
            .map(|inputs| {
                inputs
                    .keys()
                    .filter(|p| p.contains("-kiln-"))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if builds.len() != 2 {
            problems.push(format!(
                "{system}: checks.reproducible compares {} kiln builds, not two",
                builds.len()
            ));
            continue;
        }
        let both = show_derivations(builds.iter().map(String::as_str))?;
        let env = |i: usize, key: &str| {
            both[&builds[i]]["env"][key]
                .as_str()
                .unwrap_or_default()
                .to_string()
        };
        for (key, what) in [
            ("cargoArtifacts", "dependency artifacts"),
            ("NIX_OUTPATH_USED_AS_RANDOM_SEED", "bindgen seed"),
            ("postUnpack", "source folder"),
        ] {
            if env(0, key) == env(1, key) {
                problems.push(format!(
                    "{system}: the two builds checks.reproducible compares share their {what} ({key})"
                ));
            }
        }
    }
    Ok(problems)
}

/// Environment entries that say nothing a reviewer needs (the name and
/// outputs are shown apart; the rest is stdenv plumbing).
const PLUMBING: [&str; 4] = ["builder", "name", "system", "outputs"];

fn describe(path: &str, drv: &Value) -> Value {
    let outputs: Vec<&String> = drv["outputs"]
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    let inputs: BTreeSet<String> = drv["inputDrvs"]
        .as_object()
        .map(|o| o.keys().map(|p| strip_store_hashes(p)).collect())
        .unwrap_or_default();
    let sources: BTreeSet<String> = drv["inputSrcs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(strip_store_hashes)
                .collect()
        })
        .unwrap_or_default();
    let env: BTreeMap<&String, String> = drv["env"]
        .as_object()
        .map(|e| {
            e.iter()
                .filter(|(k, _)| !PLUMBING.contains(&k.as_str()) && !outputs.contains(k))
                .map(|(k, v)| (k, strip_store_hashes(v.as_str().unwrap_or_default())))
                .collect()
        })
        .unwrap_or_default();
    json!({
        "drv": strip_store_hashes(path),
        "outputs": outputs,
        "builder": strip_store_hashes(drv["builder"].as_str().unwrap_or_default()),
        "inputs": inputs,
        "sources": sources,
        "env": env,
    })
}

/// `/nix/store/<32 chars>-name` becomes `/nix/store/…-name`.
fn strip_store_hashes(text: &str) -> String {
    const STORE: &str = "/nix/store/";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(STORE) {
        out.push_str(&rest[..at + STORE.len()]);
        rest = &rest[at + STORE.len()..];
        let hash_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            .count();
        if hash_len == 32 && rest.as_bytes().get(32) == Some(&b'-') {
            out.push('…');
            rest = &rest[32..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_hashes_are_removed_and_other_text_kept() {
        let text =
            "cp /nix/store/0p5b4hv905ppcqndqwzc2hd594ky05fd-pins.json /nix/store/short-x $out";
        assert_eq!(
            strip_store_hashes(text),
            "cp /nix/store/…-pins.json /nix/store/short-x $out"
        );
    }

    #[test]
    fn a_changed_file_makes_the_summary_stale() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let mut read = serde_json::Map::new();
        for file in EVALUATOR.iter().chain(&["nix/default.nix"]) {
            let path = root.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, file).unwrap();
            read.insert(file.to_string(), json!(sha256_file(&path).unwrap()));
        }
        std::fs::write(root.join(SUMMARY), json!({ "read": read }).to_string()).unwrap();
        check(root).unwrap();

        std::fs::write(root.join("nix/default.nix"), "{ }: { }").unwrap();
        let error = check(root).unwrap_err().to_string();
        assert!(error.contains("stale: nix/default.nix changed"), "{error}");
        assert!(error.contains("cargo xtask eval-nix"), "{error}");
    }
}
