//! Speculative decoding through IREE (`local-task`): the multi-token step
//! (`append_tokens`) agrees with the CPU reference row for row, and greedy
//! speculative generation gives exactly the tokens of plain greedy
//! generation on the same backend (and the CPU reference's), with drafts
//! both accepted and rejected.
//!
//! Needs the `xla-iree` feature, `KILN_IREE_PREFIX` and `KILN_IREE_COMPILE`
//! (`cargo xtask test` sets them up).

use kiln_core::testing::max_abs_diff;
use kiln_core::{
    Backend, CpuBackend, Model, PromptLookup, SamplingParams, generate, generate_speculative,
};
use kiln_xla::{Buckets, Compiler, GraphOptions, IreeBackend, ModuleCache, Target};

/// The embedded model on `local-task` with context 64 (the multi-token
/// modules of 4 and 8 rows compile in seconds).
fn iree(model: &Model) -> IreeBackend<'_> {
    IreeBackend::new(
        model,
        "local-task",
        Target::LlvmCpu,
        GraphOptions::for_target(Target::LlvmCpu, None, None),
        Some(Compiler::from_env().unwrap_or_else(|e| panic!("{e}"))),
        ModuleCache::default_location().unwrap(),
        Buckets::for_model(model, 64),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn append_agrees_with_the_cpu_reference_and_rewinds() {
    let model = Model::embedded();
    let mut cpu = CpuBackend::new(&model);
    let mut xla = iree(&model);
    let prompt = model.tokenizer.encode("abc abd abe").unwrap();
    let vocab = model.config.vocab_size;
    for backend in [&mut cpu as &mut dyn Backend, &mut xla] {
        backend.prefill(&prompt).unwrap();
    }
    // 3 rows (the 4-row module, one padding row), rewind 2 of them, then 6
    // rows (the 8-row module) over the kept ones.
    for (tokens, keep) in [(&[5u32, 6, 7][..], 1), (&[9, 10, 11, 12, 13, 14][..], 6)] {
        let expected = cpu.append(tokens).unwrap();
        let actual = xla.append(tokens).unwrap();
        assert_eq!(actual.len(), tokens.len() * vocab);
        let diff = max_abs_diff(&expected, &actual);
        println!(
            "append of {} rows: max |iree - cpu| = {diff:e}",
            tokens.len()
        );
        assert!(diff <= 1e-4, "append of {tokens:?}: max abs diff {diff}");
        let greedy: Vec<u32> = expected
            .chunks(vocab)
            .map(kiln_core::sampling::argmax)
            .collect();
        // The device's greedy choices are the logits' (after a rewind, the
        // same rows again).
        let len = xla.sequence_len();
        xla.rewind(len - tokens.len()).unwrap();
        assert_eq!(xla.append_greedy(tokens).unwrap(), greedy);
        let kept = len - tokens.len() + keep;
        cpu.rewind(kept).unwrap();
        xla.rewind(kept).unwrap();
        assert_eq!(xla.sequence_len(), kept);
    }
    // After the rewinds, decoding continues as on the CPU.
    let diff = max_abs_diff(&cpu.decode(3).unwrap(), &xla.decode(3).unwrap());
    assert!(diff <= 1e-4, "decode after rewind: max abs diff {diff}");
    let error = xla.rewind(xla.sequence_len() + 1).unwrap_err().to_string();
    assert!(error.contains("cannot rewind"), "{error}");
}

#[test]
fn iree_cpu_speculates_losslessly() {
    let model = Model::embedded();
    let mut cpu = CpuBackend::new(&model);
    let mut xla = iree(&model);
    let stops = model.config.eos_token_ids.clone();
    let (mut proposed, mut accepted) = (0, 0);
    for text in [
        "the cat sat. the cat sat. the",
        "abc abd abe abc",
        "Once upon a time",
    ] {
        let prompt = model.tokenizer.encode(text).unwrap();
        // To the end of the context: the last steps have no room for a
        // padded multi-token step and run token by token.
        let max_tokens = 64 - prompt.len();
        let greedy = SamplingParams::default;
        let reference =
            generate(&mut cpu, &prompt, max_tokens, greedy(), &stops, |_| Ok(())).unwrap();
        let plain = generate(&mut xla, &prompt, max_tokens, greedy(), &stops, |_| Ok(())).unwrap();
        assert_eq!(
            plain, reference,
            "iree-cpu greedy differs from cpu for {text:?}"
        );
        for k in [3, 7] {
            let (tokens, stats) = generate_speculative(
                &mut xla,
                &mut PromptLookup::default(),
                k,
                &prompt,
                max_tokens,
                SamplingParams::default(),
                &stops,
                |_| Ok(()),
            )
            .unwrap();
            assert_eq!(
                tokens, plain,
                "speculative tokens differ for {text:?}, K {k}"
            );
            println!("{text:?} K {k}: {stats:?}");
            proposed += stats.proposed;
            accepted += stats.accepted;
        }
    }
    assert!(accepted > 0, "no draft was accepted");
    assert!(accepted < proposed, "no draft was rejected");
}
