//! `cargo xtask kernels`: kiln's own CUDA kernels
//! (`crates/kiln-xla/kernels/*.cu`) compiled to the PTX committed beside
//! them, which the modules embed. clang compiles them without CUDA's headers
//! or nvcc; the PTX is sm_80's (the oldest GPU kiln's modules target), which
//! the driver assembles for the real GPU at load time and `cargo xtask
//! ptxas` assembles for every pinned capability. `--check` fails where the
//! committed PTX is not what its source compiles to.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow};

use crate::pins::repo_root;

/// Debian 12's clang, whose output the committed PTX is.
pub const CLANG: &str = "clang-14";

/// The folder of the kernels' sources and PTX.
pub fn folder() -> PathBuf {
    repo_root().join("crates/kiln-xla/kernels")
}

/// Every kernel source in `folder`, sorted (its PTX: `with_extension("ptx")`).
pub fn sources(folder: &Path) -> Result<Vec<PathBuf>> {
    let mut sources: Vec<PathBuf> = std::fs::read_dir(folder)
        .with_context(|| format!("cannot read {}", folder.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    sources.retain(|path| path.extension().is_some_and(|e| e == "cu"));
    sources.sort();
    Ok(sources)
}

/// `source`'s PTX: device code only, for sm_80 with PTX ISA 7.4 (for
/// `ld.global.nc.L1::no_allocate`), no CUDA headers or libraries, and no
/// contraction of a product and a sum into an FMA the source did not write.
fn compile(source: &Path) -> Result<Vec<u8>> {
    crate::process::read_bytes(
        Command::new(CLANG)
            .args("-x cuda --cuda-device-only --cuda-gpu-arch=sm_80".split(' '))
            .args("-nocudainc -nocudalib -Xclang -target-feature -Xclang +ptx74".split(' '))
            .args("-O3 -ffp-contract=off -S -o -".split(' '))
            .arg(source),
    )
    .with_context(|| format!("{CLANG} failed on {}", source.display()))
}

/// Writes each kernel's PTX, or with `check` fails where a committed one
/// differs from it.
pub fn run(check: bool) -> Result<()> {
    crate::tools::require_host_program(CLANG, "compiles kiln's CUDA kernels to PTX")?;
    let mut stale = Vec::new();
    for source in sources(&folder())? {
        let ptx_path = source.with_extension("ptx");
        let ptx = compile(&source)?;
        if check {
            if std::fs::read(&ptx_path).ok().as_deref() != Some(ptx.as_slice()) {
                stale.push(ptx_path.display().to_string());
            }
        } else {
            std::fs::write(&ptx_path, &ptx)?;
            println!("wrote {}", ptx_path.display());
        }
    }
    if !stale.is_empty() {
        return Err(anyhow!(
            "not what their sources compile to: {} (run `cargo xtask kernels`)",
            stale.join(", ")
        ));
    }
    Ok(())
}
