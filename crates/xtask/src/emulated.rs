//! `cargo xtask emulated-tests`: tests of another architecture's build run
//! here under user-mode emulation (`qemu-aarch64`). They are the test
//! executables the gate's link check built for that target (release,
//! `cuda,xla-iree`), so they cost no second build of the workspace for it:
//! kiln-core's unit tests, kiln-cpu's (there its portable block kernels,
//! which x86_64 runs only in its tests), and `xla_prepared_prefill` on `local-task`, whose
//! modules the pinned `iree-compile` generates for the target's architecture
//! and whose logits are held to the same CPU-reference bounds as on x86_64.
//! Its CUDA tests are left out: no GPU is emulated.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};

use crate::gate::test_executables;
use crate::target::Target;

/// The tests run, each a cargo target (kind, name) and its test-name filters.
const TESTS: [(&str, &str, &[&str]); 4] = [
    ("lib", "kiln_core", &[]),
    ("lib", "kiln_cpu", &[]),
    ("test", "against_reference", &[]),
    ("test", "xla_prepared_prefill", &["--skip", "cuda::"]),
];

/// Runs [`TESTS`] for `target` (a cross target) against its CUDA `prefix`,
/// with `compiler` for the modules; fails on the first that fails.
pub fn run(prefix: &Path, compiler: &Path, target: &Target) -> Result<()> {
    if !target.cross {
        return Err(anyhow!(
            "{} is this machine's own target: run its tests with `cargo test`",
            target.triple
        ));
    }
    let built = test_executables(prefix, target)?;
    for (kind, name, filters) in TESTS {
        let test = built
            .iter()
            .find(|t| t.kind == kind && t.name == name)
            .ok_or_else(|| {
                anyhow!("the link check built no {kind} test named {name}; was it renamed? (crates/xtask/src/emulated.rs lists the tests run)")
            })?;
        let started = Instant::now();
        let status = target
            .runner(&test.path)?
            .args(filters)
            .current_dir(&test.package_dir)
            .env("KILN_IREE_COMPILE", compiler)
            .status()
            .with_context(|| format!("cannot run {}", test.path.display()))?;
        eprintln!(
            "{name} ({}) under emulation: {status} in {:.1}s",
            target.triple,
            started.elapsed().as_secs_f64()
        );
        if !status.success() {
            return Err(anyhow!(
                "{name} failed for {} under emulation ({status})",
                target.triple
            ));
        }
    }
    Ok(())
}
