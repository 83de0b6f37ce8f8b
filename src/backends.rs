//! Choosing a backend by name. A backend that was not compiled in, or whose
//! device is absent, is an error: kiln never falls back to another one.

use anyhow::{Result, bail};
use clap::ValueEnum;
use kiln_core::{Backend, CpuBackend, Model};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The pure-Rust CPU reference.
    Cpu,
    /// IREE on the CPU (`local-task`), modules compiled for llvm-cpu.
    IreeCpu,
    /// IREE on an NVIDIA GPU (`cuda`), sm_80 PTX JIT-compiled by the driver.
    IreeCuda,
}

/// Backend options that only the IREE backends use.
#[derive(Clone, Debug, clap::Args)]
pub struct IreeOptions {
    /// Longest sequence (prompt plus generated tokens) the IREE modules hold.
    #[arg(long, default_value_t = 256)]
    pub max_context: usize,
}

pub fn open<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &IreeOptions,
) -> Result<Box<dyn Backend + 'm>> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(CpuBackend::new(model))),
        BackendKind::IreeCpu | BackendKind::IreeCuda => iree(model, kind, options),
    }
}

#[cfg(feature = "xla-iree")]
fn iree<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &IreeOptions,
) -> Result<Box<dyn Backend + 'm>> {
    Ok(Box::new(open_iree(model, kind, options)?))
}

/// The IREE backend itself (for `prepare`, which needs more than the trait).
#[cfg(feature = "xla-iree")]
pub fn open_iree<'m>(
    model: &'m Model,
    kind: BackendKind,
    options: &IreeOptions,
) -> Result<kiln_xla::IreeBackend<'m>> {
    use kiln_xla::{Buckets, Compiler, IreeBackend, ModuleCache, Target};
    let (uri, target) = match kind {
        BackendKind::IreeCuda if !cfg!(feature = "cuda") => bail!(
            "the iree-cuda backend is not compiled into this kiln; rebuild with `--features cuda,xla-iree`"
        ),
        BackendKind::IreeCuda => ("cuda", Target::Cuda),
        BackendKind::IreeCpu => ("local-task", Target::LlvmCpu),
        BackendKind::Cpu => bail!("the cpu backend is not an IREE backend"),
    };
    if options.max_context == 0 {
        bail!("--max-context must be positive");
    }
    let buckets = Buckets::for_model(model, options.max_context);
    let backend = IreeBackend::new(
        model,
        uri,
        target,
        Compiler::from_env()?,
        ModuleCache::default_location()?,
        buckets,
    )?;
    Ok(backend)
}

#[cfg(not(feature = "xla-iree"))]
fn iree<'m>(
    _model: &'m Model,
    kind: BackendKind,
    _options: &IreeOptions,
) -> Result<Box<dyn Backend + 'm>> {
    let features = if kind == BackendKind::IreeCuda {
        "cuda,xla-iree"
    } else {
        "xla-iree"
    };
    bail!(
        "the {} backend is not compiled into this kiln; rebuild with `--features {features}`",
        kind.to_possible_value()
            .expect("no skipped variants")
            .get_name()
    )
}
