//! Prepared modules: the StableHLO text of each module a model needs, its
//! cache key, and compiling it into the cache — with no device, so modules for
//! a GPU can be prepared on a machine without one and carried to it.

use kiln_core::ModelConfig;

use crate::backend::{Buckets, ModuleKind};
use crate::compiler::{Compiler, Target};
use crate::error::{Error, Result};
use crate::graph::GraphOptions;
use crate::llama;
use crate::module_cache::{ModuleCache, Origin};

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
    }
}

/// Every module of a model for `buckets`.
pub fn module_kinds(buckets: &Buckets) -> Vec<ModuleKind> {
    let mut kinds: Vec<ModuleKind> = buckets
        .prefill
        .iter()
        .map(|&s| ModuleKind::Prefill(s))
        .collect();
    kinds.push(ModuleKind::Decode);
    kinds
}

/// The `.vmfb` of one module: from the cache, or compiled into it. The key
/// covers the MLIR text, the target's flags, the compiler's identity — the
/// IREE revision, which `Compiler` guarantees equals the runtime's — and the
/// bucket. Without a compiler, only the cache can serve.
pub fn obtain(
    config: &ModelConfig,
    graph: &GraphOptions,
    kind: ModuleKind,
    buckets: &Buckets,
    target: Target,
    compiler: Option<&Compiler>,
    cache: &ModuleCache,
) -> Result<(Vec<u8>, Origin)> {
    let (mlir, bucket) = source(config, graph, kind, buckets.context);
    // Without a compiler only the cache serves, with the key of modules
    // compiled on a machine of kiln's own architecture.
    let flags = target
        .flags(compiler.is_none_or(Compiler::is_native))
        .join(" ");
    let key = ModuleCache::key(&[&mlir, &flags, kiln_iree::RUNTIME_REVISION, &bucket]);
    cache.get_or_compile(&key, || match compiler {
        Some(compiler) => compiler.compile(&mlir, target),
        None => Err(Error::NotPrepared {
            module: format!("{kind:?} for {target:?}"),
            cache: cache.dir().to_path_buf(),
        }),
    })
}

/// Compiles every module of `config` for `target` into `cache` (no device
/// needed), reporting each as it is ready.
pub fn prepare(
    config: &ModelConfig,
    graph: &GraphOptions,
    buckets: &Buckets,
    target: Target,
    compiler: &Compiler,
    cache: &ModuleCache,
    mut on_ready: impl FnMut(ModuleKind, Origin, std::time::Duration),
) -> Result<()> {
    for kind in module_kinds(buckets) {
        let started = std::time::Instant::now();
        let (_, origin) = obtain(config, graph, kind, buckets, target, Some(compiler), cache)?;
        on_ready(kind, origin, started.elapsed());
    }
    Ok(())
}
