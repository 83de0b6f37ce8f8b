//! Prepared modules: the StableHLO text of each module a model needs, its
//! cache key, and compiling it into the cache — with no device, so modules for
//! a GPU can be prepared on a machine without one and carried to it.
//! Which modules a model needs is the plan's (`plan`); its lists are
//! re-exported here, where callers prepare them.

use kiln_core::ModelConfig;

use crate::compiler::{Compiler, Target};
use crate::error::{Error, Result};
use crate::graph::GraphOptions;
use crate::llama;
use crate::module_cache::{ModuleCache, Origin};
use crate::plan::{Buckets, ModuleKind};
// The lists of modules to prepare, at their public path `prepared::...`.
pub use crate::plan::{append_module_kinds, batch_module_kinds, module_kinds};

/// The MLIR text of a module and the bucket it is for.
pub fn source(
    config: &ModelConfig,
    graph: &GraphOptions,
    kind: ModuleKind,
    context: usize,
) -> (String, String) {
    match kind {
        ModuleKind::Prefill(seq) => (
            llama::prefill_module(config, graph, seq, context),
            format!("prefill:{seq}:{context}"),
        ),
        ModuleKind::Decode => (
            llama::decode_module(config, graph, context),
            format!("decode:{context}"),
        ),
        ModuleKind::DecodeChain(steps) => (
            llama::decode_chain_module(config, graph, context, steps),
            format!("decode-chain:{steps}:{context}"),
        ),
        ModuleKind::DecodeBatch { rows, slots } => (
            llama::decode_batch_module(config, graph, context, rows, slots),
            format!("decode-batch:{rows}:{slots}:{context}"),
        ),
        ModuleKind::AdmitSlot { slots } => (
            llama::admit_slot_module(config, graph, context, slots),
            format!("admit-slot:{slots}:{context}"),
        ),
        ModuleKind::PrefillBatch { rows, seq, slots } => (
            llama::prefill_batch_module(config, graph, context, rows, seq, slots),
            format!("prefill-batch:{rows}:{seq}:{slots}:{context}"),
        ),
        ModuleKind::Append(rows) => (
            llama::append_module(config, graph, context, rows),
            format!("append:{rows}:{context}"),
        ),
    }
}

/// The cache key of a module: the MLIR text, the target's flags (which
/// depend on whether the compiler runs natively: see [`Target::flags`]) and
/// the module kind's ([`ModuleKind::compile_flags`]),
/// the machine they resolve to (the host CPU for native llvm-cpu), the
/// compiler's identity — the IREE revision, which `Compiler` guarantees
/// equals the runtime's — and the bucket.
pub fn key(
    mlir: &str,
    bucket: &str,
    target: Target,
    extra_flags: &[&str],
    native_compiler: bool,
) -> Result<String> {
    let machine = target.machine_identity(native_compiler)?;
    Ok(key_on(
        mlir,
        bucket,
        target,
        extra_flags,
        native_compiler,
        machine,
    ))
}

/// [`key`] on a machine of the given identity.
fn key_on(
    mlir: &str,
    bucket: &str,
    target: Target,
    extra_flags: &[&str],
    native_compiler: bool,
    machine: &str,
) -> String {
    let mut flags = target.flags(native_compiler).to_vec();
    flags.extend_from_slice(extra_flags);
    let flags = flags.join(" ");
    ModuleCache::key(&[mlir, &flags, machine, kiln_iree::RUNTIME_REVISION, bucket])
}

/// The `.vmfb` of one module: from the cache, or compiled into it (see
/// [`key`]). Without a compiler, only the cache can serve.
pub fn obtain(
    config: &ModelConfig,
    graph: &GraphOptions,
    kind: ModuleKind,
    buckets: &Buckets,
    target: Target,
    compiler: Option<&Compiler>,
    cache: &ModuleCache,
) -> Result<(Vec<u8>, Origin)> {
    // The graph's sizes are products of the config's: bounded only if valid.
    config.validate().map_err(Error::Config)?;
    graph.check().map_err(Error::Graph)?;
    let (mlir, bucket) = source(config, graph, kind, buckets.context);
    // Without a compiler only the cache serves, with the key of modules
    // compiled on a machine of kiln's own architecture.
    let native_compiler = compiler.is_none_or(Compiler::is_native);
    let extra_flags = kind.compile_flags(target);
    let key = key(&mlir, &bucket, target, extra_flags, native_compiler)?;
    cache.get_or_compile(&key, || match compiler {
        Some(compiler) => compiler.compile(&mlir, target, extra_flags),
        None => Err(Error::NotPrepared {
            module: format!("{kind:?} for {target:?}"),
            cache: cache.dir().to_path_buf(),
        }),
    })
}

/// Compiles the modules `kinds` of `config` for `target` into `cache` (no
/// device needed), reporting each as it is ready.
#[allow(clippy::too_many_arguments)]
pub fn prepare_kinds(
    config: &ModelConfig,
    graph: &GraphOptions,
    kinds: &[ModuleKind],
    buckets: &Buckets,
    target: Target,
    compiler: &Compiler,
    cache: &ModuleCache,
    mut on_ready: impl FnMut(ModuleKind, Origin, std::time::Duration),
) -> Result<()> {
    for &kind in kinds {
        let started = std::time::Instant::now();
        let (_, origin) = obtain(config, graph, kind, buckets, target, Some(compiler), cache)?;
        on_ready(kind, origin, started.elapsed());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_modules_of_different_cpus_have_different_keys() {
        let avx512 = crate::host_cpu::from_cpuinfo("flags: sse2 avx2 avx512f").unwrap();
        let avx2 = crate::host_cpu::from_cpuinfo("flags: sse2 avx2").unwrap();
        let key = |target, machine| key_on("mlir", "decode:64", target, &[], true, machine);
        assert_ne!(key(Target::LlvmCpu, &avx512), key(Target::LlvmCpu, &avx2));
    }

    #[test]
    fn generic_modules_of_another_architectures_compiler_have_their_own_key() {
        let native = key("mlir", "decode:64", Target::LlvmCpu, &[], true).unwrap();
        let generic = key("mlir", "decode:64", Target::LlvmCpu, &[], false).unwrap();
        assert_ne!(native, generic);
        // `generic` code does not depend on the CPU the compiler runs on.
        assert_eq!(
            generic,
            key_on("mlir", "decode:64", Target::LlvmCpu, &[], false, "")
        );
    }
}
