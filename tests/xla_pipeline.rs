//! The greedy decode pipeline: `IreeBackend::decode_greedy` queues the next
//! step before it waits for this step's token, and drops that step when the
//! caller goes another way. The pipeline changes when work is queued, never
//! what it computes: on `local-task`, pipelined and unpipelined backends give
//! bit-identical tokens and logits, also where a caller leaves the pipeline
//! (another token, sampled logits, a rewind, a new prompt, a multi-token
//! step) and at the end of the context, where nothing is queued ahead.
//!
//! Needs the `xla-iree` feature, `KILN_IREE_PREFIX` and `KILN_IREE_COMPILE`
//! (`cargo xtask test` sets them up); without the feature the file is empty.
#![cfg(feature = "xla-iree")]

use std::path::PathBuf;

use kiln_core::{Backend, CpuBackend, Model, SamplingParams, generate};
use kiln_xla::{Buckets, Compiler, GraphOptions, IreeBackend, ModuleCache, Target};

const CONTEXT: usize = 64;

/// The embedded model on `local-task`, with or without the pipeline.
fn iree(model: &Model, pipelined: bool) -> IreeBackend<'_> {
    let mut backend = IreeBackend::new(
        model,
        "local-task",
        Target::LlvmCpu,
        GraphOptions::for_target(Target::LlvmCpu, None, None),
        Some(Compiler::from_env().unwrap_or_else(|e| panic!("{e}"))),
        ModuleCache::default_location().unwrap(),
        Buckets::for_model(model, CONTEXT),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    backend.set_pipelined(pipelined);
    backend
}

#[test]
fn the_pipeline_changes_no_token() {
    let model = Model::embedded();
    let mut cpu = CpuBackend::new(&model);
    let mut pipelined = iree(&model, true);
    let mut unpipelined = iree(&model, false);
    for text in ["the cat sat. the", "Once upon a time"] {
        let prompt = model.tokenizer.encode(text).unwrap();
        // To the end of the context, with no stop token: the last step has
        // no room to queue another behind it.
        let max_tokens = CONTEXT - prompt.len();
        let run = |backend: &mut dyn Backend| {
            generate(
                backend,
                &prompt,
                max_tokens,
                SamplingParams::default(),
                &[],
                |_| Ok(()),
            )
            .unwrap()
        };
        let reference = run(&mut cpu);
        let with = run(&mut pipelined);
        let without = run(&mut unpipelined);
        assert_eq!(with.len(), max_tokens, "{text:?}");
        assert_eq!(with, without, "{text:?}: the pipeline changed the tokens");
        assert_eq!(with, reference, "{text:?}: iree-cpu differs from cpu");
        assert_eq!(pipelined.sequence_len(), CONTEXT - 1);
    }
}

/// What a caller observed: a greedy token or a row of logits.
#[derive(Debug, PartialEq)]
enum Seen {
    Token(u32),
    Logits(Vec<f32>),
}

/// A test fixture: a small random Llama whose greedy tokens vary from step
/// to step (the embedded model's repeat), so that a step at the wrong
/// position shows.
fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Model::load(&dir).unwrap()
}

/// `n` greedy steps from `token`, each chosen token observed.
fn greedy(backend: &mut IreeBackend, token: &mut u32, n: usize, seen: &mut Vec<Seen>) {
    for _ in 0..n {
        *token = backend.decode_greedy(*token).unwrap();
        seen.push(Seen::Token(*token));
    }
}

#[test]
fn leaving_the_pipeline_anywhere_gives_the_unpipelined_result() {
    let model = fixture("llama-gqa-untied");
    let prompt = [1, 17, 42, 99, 7];
    let vocab = model.config.vocab_size as u32;
    // Each operation after the first greedy steps follows a greedy step, so
    // a step is queued ahead of it.
    let script = |backend: &mut IreeBackend| -> Vec<Seen> {
        let mut seen = Vec::new();
        let logits = backend.prefill(&prompt).unwrap();
        let mut token = kiln_core::sampling::argmax(&logits);
        greedy(backend, &mut token, 4, &mut seen);
        // Another token than the device chose, as a sampler would pick.
        let mut other = (token + 1) % vocab;
        greedy(backend, &mut other, 3, &mut seen);
        // Logits for sampling, of the token the queued step assumed.
        let logits = backend.decode(other).unwrap();
        token = kiln_core::sampling::argmax(&logits);
        seen.push(Seen::Logits(logits));
        greedy(backend, &mut token, 3, &mut seen);
        // A rewind over a row another token wrote, then the queued step's
        // token again: its step must run at the rewound position and
        // overwrite that row, which the logits after it read.
        let forced = (token + 1) % vocab;
        seen.push(Seen::Logits(backend.decode(forced).unwrap()));
        greedy(backend, &mut token, 1, &mut seen);
        let len = backend.sequence_len();
        backend.rewind(len - 2).unwrap();
        greedy(backend, &mut token, 1, &mut seen);
        seen.push(Seen::Logits(backend.decode(token).unwrap()));
        // A multi-token step, then greedy again.
        seen.push(Seen::Logits(backend.append(&[5, 6, 7]).unwrap()));
        greedy(backend, &mut token, 2, &mut seen);
        // A new prompt, then greedy again.
        seen.push(Seen::Logits(backend.prefill(&prompt[..3]).unwrap()));
        greedy(backend, &mut token, 2, &mut seen);
        seen.push(Seen::Token(backend.sequence_len() as u32));
        seen
    };
    let with = script(&mut iree(&model, true));
    let without = script(&mut iree(&model, false));
    assert_eq!(with.len(), without.len());
    for (i, (a, b)) in with.iter().zip(&without).enumerate() {
        assert_eq!(a, b, "observation {i} differs with the pipeline");
    }
}
