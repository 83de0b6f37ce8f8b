//! `cargo xtask env`: shell exports that point a build at the IREE prefix and
//! the compiler — the non-Nix twin of `nix develop`.

use std::path::Path;

use anyhow::{Result, anyhow};

use crate::cache::Cache;
use crate::compiler::compiler_location;
use crate::iree::{Variant, prefix_location};
use crate::pins::Pins;
use crate::target::Target;

/// The exports, one `export NAME=VALUE` line each, values shell-quoted.
pub fn exports(cache: &Cache, pins: &Pins, variant: Variant, target: &Target) -> Result<String> {
    let (prefix, _) = prefix_location(cache, pins, variant, target)?;
    if !prefix.exists() {
        let mut flag = if variant == Variant::Cuda {
            " --cuda".to_string()
        } else {
            String::new()
        };
        if target.cross {
            flag.push_str(&format!(" --target {}", target.triple));
        }
        return Err(anyhow!(
            "no IREE prefix ({}) for the current pins at {}; build it with `cargo xtask iree{flag}`",
            variant.name(),
            prefix.display()
        ));
    }
    let compiler = compiler_location(cache, pins)?;
    if !compiler.exists() {
        return Err(anyhow!(
            "no iree-compile for the current pins at {}; install it with `cargo xtask compiler`",
            compiler.display()
        ));
    }
    let mut exports = format!(
        "export KILN_IREE_PREFIX={}\nexport KILN_IREE_COMPILE={}\n",
        quote(&prefix)?,
        quote(&compiler)?
    );
    // A cross target's linker and runner, for `cargo build --target T`.
    for (name, value) in target.cargo_env() {
        exports.push_str(&format!("export {name}={}\n", quote(Path::new(&value))?));
    }
    Ok(exports)
}

fn quote(path: &Path) -> Result<String> {
    let text = path
        .to_str()
        .ok_or_else(|| anyhow!("{} is not valid UTF-8", path.display()))?;
    Ok(shlex::try_quote(text)
        .map_err(|e| anyhow!("cannot quote {text}: {e}"))?
        .into_owned())
}
