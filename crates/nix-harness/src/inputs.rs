//! The flake's GitHub inputs: nixpkgs' `lib`, crane and rust-overlay at the
//! revisions `flake.lock` pins, from a folder the user names (or downloaded
//! by the caller, which checks each tree with [`verify`]). Each tree is
//! checked against the lock file's NAR hash before use (nixpkgs' `lib/` alone
//! cannot be: its hash is recorded in the summary instead).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::read;

/// Where each input lies on this machine.
pub struct Inputs {
    /// A folder with nixpkgs' `lib/` in it (a nixpkgs tree, or nixpkgs.lib).
    pub nixpkgs_lib: PathBuf,
    pub crane: PathBuf,
    pub rust_overlay: PathBuf,
    /// What the summary says about them.
    pub provenance: Value,
}

#[derive(Deserialize)]
struct Lock {
    nodes: std::collections::BTreeMap<String, Node>,
}

#[derive(Deserialize)]
struct Node {
    locked: Option<Locked>,
}

/// One input as `flake.lock` pins it.
#[derive(Deserialize, Clone)]
#[serde(rename_all = "camelCase")]
pub struct Locked {
    pub nar_hash: String,
    pub owner: String,
    pub repo: String,
    pub rev: String,
}

/// The locked input `name` of the flake at `root`.
pub fn locked(root: &Path, name: &str) -> Result<Locked> {
    let path = root.join("flake.lock");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let lock: Lock = serde_json::from_str(&text).context("flake.lock is malformed")?;
    lock.nodes
        .get(name)
        .and_then(|n| n.locked.clone())
        .ok_or_else(|| anyhow!("flake.lock has no locked input `{name}`"))
}

/// The NAR hash of a tree, as hex (`nix-hash`, Debian's nix-bin).
fn nar_hash_hex(dir: &Path) -> Result<String> {
    nix_hash(&["--type".as_ref(), "sha256".as_ref(), dir.as_os_str()])
}

fn sri_to_hex(sri: &str) -> Result<String> {
    nix_hash(&[
        "--type".as_ref(),
        "sha256".as_ref(),
        "--to-base16".as_ref(),
        sri.as_ref(),
    ])
}

fn nix_hash(args: &[&std::ffi::OsStr]) -> Result<String> {
    read(Command::new("nix-hash").args(args))
}

/// Fails unless `dir` is the locked input `name`, byte for byte.
pub fn verify(name: &str, dir: &Path, lock: &Locked) -> Result<()> {
    if !dir.is_dir() {
        return Err(anyhow!(
            "{} is missing: put {}/{} at rev {} there (e.g. `git -C MIRROR archive {} | tar x -C {}`)",
            dir.display(),
            lock.owner,
            lock.repo,
            lock.rev,
            lock.rev,
            dir.display()
        ));
    }
    let (found, wanted) = (nar_hash_hex(dir)?, sri_to_hex(&lock.nar_hash)?);
    if found != wanted {
        return Err(anyhow!(
            "{} is not {name} at the locked revision {}: its NAR hash is {found}, flake.lock's is {wanted} ({}). \
             Extract exactly that revision there.",
            dir.display(),
            lock.rev,
            lock.nar_hash
        ));
    }
    Ok(())
}

/// The inputs of the flake at `root` from `dir`: `dir/nixpkgs-lib` (a folder
/// holding nixpkgs' `lib/`), `dir/crane` and `dir/rust-overlay`.
pub fn from_folder(root: &Path, dir: &Path) -> Result<Inputs> {
    let crane = locked(root, "crane")?;
    let overlay = locked(root, "rust-overlay")?;
    let nixpkgs = locked(root, "nixpkgs")?;
    let inputs = Inputs {
        nixpkgs_lib: dir.join("nixpkgs-lib"),
        crane: dir.join("crane"),
        rust_overlay: dir.join("rust-overlay"),
        provenance: json!(null),
    };
    verify("crane", &inputs.crane, &crane)?;
    verify("rust-overlay", &inputs.rust_overlay, &overlay)?;
    let lib = inputs.nixpkgs_lib.join("lib");
    if !lib.join("default.nix").is_file() {
        return Err(anyhow!(
            "{} has no lib/default.nix: put nixpkgs' lib/ (nixpkgs at {}, or nix-community/nixpkgs.lib at the matching commit) there",
            inputs.nixpkgs_lib.display(),
            nixpkgs.rev
        ));
    }
    let version = std::fs::read_to_string(lib.join(".version")).unwrap_or_default();
    let provenance = json!({
        "crane": format!("{}/{} {} (NAR hash verified against flake.lock)", crane.owner, crane.repo, crane.rev),
        "rust-overlay": format!("{}/{} {} (NAR hash verified against flake.lock)", overlay.owner, overlay.repo, overlay.rev),
        "nixpkgs-lib": format!(
            "lib/ {} with NAR hash sha256:{} from a folder (flake.lock pins nixpkgs {}; lib/ alone has no locked hash)",
            version.trim(),
            nar_hash_hex(&lib)?,
            nixpkgs.rev
        ),
    });
    Ok(Inputs {
        provenance,
        ..inputs
    })
}
