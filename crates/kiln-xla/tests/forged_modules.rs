//! A module in the cache that loads and runs but does not fit the model (a
//! damaged entry, or one planted by whoever could write the folder) is an
//! error naming the cache, never a panic on its outputs.
//!
//! Needs `KILN_IREE_PREFIX` and `KILN_IREE_COMPILE`, as `cargo xtask test`
//! provides.

use kiln_core::{Backend, Model, SamplingParams, generate};
use kiln_xla::{Buckets, Compiler, GraphOptions, IreeBackend, ModuleCache, ModuleKind, Target};

const CONTEXT: usize = 64;

/// Valid modules with the embedded model's signatures whose prefill returns
/// `logits` f32 values and whose decode step returns `next` tokens.
fn forged(logits: usize, next: usize) -> String {
    let kv = "tensor<2x2x64x16xf32>, tensor<2x2x16x64xf32>";
    format!(
        r#"
module {{
  func.func @prefill_ids(%ids: tensor<16xi32>, %len: tensor<i32>, %cos: tensor<64x8xf32>,
      %sin: tensor<64x8xf32>, %w: tensor<98880xf32>) -> (tensor<{logits}xf32>, {kv}) {{
    %l = stablehlo.constant dense<0.0> : tensor<{logits}xf32>
    %k = stablehlo.constant dense<0.0> : tensor<2x2x64x16xf32>
    %v = stablehlo.constant dense<0.0> : tensor<2x2x16x64xf32>
    return %l, %k, %v : tensor<{logits}xf32>, {kv}
  }}
  func.func @decode_step(%t: tensor<1xi32>, %p: tensor<i32>,
      %k: tensor<2x2x64x16xf32> {{iree.abi.output = 3 : index}},
      %v: tensor<2x2x16x64xf32> {{iree.abi.output = 4 : index}}, %cos: tensor<64x8xf32>,
      %sin: tensor<64x8xf32>, %w: tensor<98880xf32>)
      -> (tensor<98xf32>, tensor<{next}xi32>, tensor<i32>, {kv}) {{
    %l = stablehlo.constant dense<0.0> : tensor<98xf32>
    %n = stablehlo.constant dense<0> : tensor<{next}xi32>
    return %l, %n, %p, %k, %v : tensor<98xf32>, tensor<{next}xi32>, tensor<i32>, {kv}
  }}
}}
"#
    )
}

/// A backend on a cache holding `mlir`, compiled, under the keys of the
/// embedded model's real prefill (bucket 16) and decode modules; no compiler,
/// so only the cache serves.
fn backend_with(model: &Model, mlir: &str, cache_dir: &std::path::Path) -> IreeBackend<'static> {
    let compiler = Compiler::from_env().unwrap_or_else(|e| panic!("{e}"));
    let graph = GraphOptions::for_target(Target::LlvmCpu, None, None);
    let cache = ModuleCache::at(cache_dir);
    for kind in [ModuleKind::Prefill(16), ModuleKind::Decode] {
        // Compiled as the real module of its kind is (the decode step's
        // execution model), so that it runs and only its outputs are wrong.
        let flags = kind.compile_flags(Target::LlvmCpu);
        let vmfb = compiler
            .compile(mlir, Target::LlvmCpu, flags)
            .unwrap_or_else(|e| panic!("{e}"));
        let (real, bucket) = kiln_xla::prepared::source(&model.config, &graph, kind, CONTEXT);
        let key =
            kiln_xla::prepared::key(&real, &bucket, Target::LlvmCpu, flags, compiler.is_native())
                .unwrap();
        cache.get_or_compile(&key, || Ok(vmfb)).unwrap();
    }
    let model: &'static Model = Box::leak(Box::new(Model::embedded()));
    IreeBackend::new(
        model,
        "local-task",
        Target::LlvmCpu,
        graph,
        None,
        ModuleCache::at(cache_dir),
        Buckets::for_model(model, CONTEXT),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn assert_names_the_cache(error: kiln_core::Error) {
    let text = error.to_string();
    assert!(text.contains("does not fit this model"), "{text}");
}

#[test]
fn empty_logits_from_a_forged_prefill_are_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut backend = backend_with(&Model::embedded(), &forged(0, 1), dir.path());
    assert_names_the_cache(backend.prefill(&[1, 2, 3]).unwrap_err());
    // The generation loop, sampling or greedy, stops at the same error.
    for temperature in [0.0, 1.0] {
        let sampling = SamplingParams {
            temperature,
            ..SamplingParams::default()
        };
        let error = generate(&mut backend, &[1, 2, 3], 4, sampling, &[], |_| Ok(())).unwrap_err();
        assert_names_the_cache(error);
    }
}

#[test]
fn a_forged_greedy_step_without_a_token_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut backend = backend_with(&Model::embedded(), &forged(98, 0), dir.path());
    assert_eq!(backend.prefill(&[1, 2, 3]).unwrap().len(), 98);
    assert_names_the_cache(backend.decode_greedy(5).unwrap_err());
}
