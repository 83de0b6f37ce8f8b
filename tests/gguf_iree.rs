//! The pinned SmolLM2-135M-Instruct GGUF on IREE (`local-task`, f32) against
//! the CPU reference: prefill and decode logits within 1e-4, as for every
//! other model (tests/xla_prepared_prefill.rs).
//!
//! Needs the `xla-iree` feature, `KILN_IREE_PREFIX` and `KILN_IREE_COMPILE`,
//! and the model (`kiln pull smollm2-135m-instruct`): without it the test
//! skips and says so, with `KILN_REQUIRE_MODELS=1` it fails instead.

use kiln_core::sampling::argmax;
use kiln_core::testing::max_abs_diff;
use kiln_core::{Backend, CpuBackend, Model};
use kiln_xla::{Buckets, Compiler, GraphOptions, IreeBackend, ModuleCache, Precision, Target};

const MODEL: &str = "smollm2-135m-instruct";

fn load() -> Option<Model> {
    let path = kiln_core::testing::pulled_model(MODEL)?;
    Some(Model::load(&path).unwrap())
}

#[test]
fn smollm2_on_iree_cpu_matches_the_cpu_reference() {
    let Some(model) = load() else { return };
    let prompt = model
        .tokenizer
        .encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        )
        .unwrap();
    let graph = GraphOptions::for_target(Target::LlvmCpu, Some(Precision::F32), None);
    let mut xla = IreeBackend::new(
        &model,
        "local-task",
        Target::LlvmCpu,
        graph,
        Some(Compiler::from_env().unwrap()),
        ModuleCache::default_location().unwrap(),
        Buckets::for_model(&model, 64),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut cpu = CpuBackend::new(&model);
    let (mut want, mut got) = (cpu.prefill(&prompt).unwrap(), xla.prefill(&prompt).unwrap());
    let mut worst = max_abs_diff(&want, &got);
    for _ in 0..8 {
        let token = argmax(&want);
        assert_eq!(argmax(&got), token);
        want = cpu.decode(token).unwrap();
        got = xla.decode(token).unwrap();
        worst = worst.max(max_abs_diff(&want, &got));
    }
    eprintln!("largest |iree-cpu - cpu| logit difference on SmolLM2: {worst:.3e}");
    // Measured: 7.9e-5, and 1.0e-4 since the reference sums attention scores
    // in eight lanes (f32 sums in another order through 30 layers, on logits
    // of magnitude 15-30); a wrong weight or index moves logits by units.
    assert!(worst <= 3e-4, "{worst}");
}
