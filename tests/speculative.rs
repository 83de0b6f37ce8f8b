//! Speculative decoding is lossless: with greedy choice it generates exactly
//! the tokens of plain `generate`, token for token, stopping at the same
//! place — on the CPU reference with the embedded model, the transformers
//! fixtures and (when pulled) SmolLM2. Every comparison also requires that
//! the proposer had drafts both accepted and rejected, so that neither the
//! accept path nor the rewind path can go untested.

use std::path::PathBuf;

use kiln_core::speculative::SpeculationStats;
use kiln_core::{
    Backend, CpuBackend, Model, PromptLookup, SamplingParams, generate, generate_speculative,
};

/// Plain greedy generation and speculative generation with prompt lookup
/// (K = `draft_tokens`) of the same prompt; asserts the tokens, and the
/// tokens passed to the callback, are equal; returns the statistics.
fn compare(
    backend: &mut dyn Backend,
    prompt: &[u32],
    max_tokens: usize,
    stop_tokens: &[u32],
    draft_tokens: usize,
) -> SpeculationStats {
    let plain = generate(
        backend,
        prompt,
        max_tokens,
        SamplingParams::default(),
        stop_tokens,
        |_| Ok(()),
    )
    .unwrap();
    let mut streamed = Vec::new();
    let (speculated, stats) = generate_speculative(
        backend,
        &mut PromptLookup::default(),
        draft_tokens,
        prompt,
        max_tokens,
        SamplingParams::default(),
        stop_tokens,
        |t| {
            streamed.push(t);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(
        speculated, plain,
        "speculative tokens differ from greedy ones (prompt {prompt:?}, K {draft_tokens})"
    );
    assert_eq!(streamed, plain, "the callback saw other tokens");
    assert_eq!(stats.generated, plain.len());
    assert!(stats.accepted <= stats.proposed);
    stats
}

/// Compares every prompt at several K and max_tokens, and again with a stop
/// token that greedy decoding meets part way; adds the statistics to `total`.
fn compare_all(
    model: &Model,
    backend: &mut dyn Backend,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    total: &mut SpeculationStats,
) {
    let mut add = |s: SpeculationStats| {
        total.steps += s.steps;
        total.proposed += s.proposed;
        total.accepted += s.accepted;
        total.generated += s.generated;
    };
    let stops = model.config.eos_token_ids.clone();
    for prompt in prompts {
        for k in [1, 3, 8] {
            add(compare(backend, prompt, max_tokens, &stops, k));
        }
        for max in [1, 2, 5] {
            add(compare(backend, prompt, max, &stops, 4));
        }
        // A stop token met part way: the first token greedy decoding
        // produces after its fourth that is not among the first four.
        let plain = generate(
            backend,
            prompt,
            max_tokens,
            SamplingParams::default(),
            &[],
            |_| Ok(()),
        )
        .unwrap();
        if let Some(&stop) = plain.iter().skip(4).find(|t| !plain[..4].contains(t)) {
            let stats = compare(backend, prompt, max_tokens, &[stop], 4);
            assert!(stats.generated < plain.len(), "the stop token did not stop");
            add(stats);
        }
    }
    println!("{}: {total:?} so far", model.name);
}

/// Both paths taken: some drafts accepted, some rejected.
fn assert_accepted_and_rejected(total: &SpeculationStats) {
    assert!(total.accepted > 0, "no draft was accepted: {total:?}");
    assert!(
        total.accepted < total.proposed,
        "no draft was rejected: {total:?}"
    );
}

fn encode(model: &Model, texts: &[&str]) -> Vec<Vec<u32>> {
    texts
        .iter()
        .map(|t| model.tokenizer.encode(t).unwrap())
        .collect()
}

const TEXTS: [&str; 3] = [
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "Once upon a time",
    "abc abd abe abc abd abe abc",
];

#[test]
fn embedded_model_on_cpu_speculates_losslessly() {
    let model = Model::embedded();
    let prompts = encode(&model, &TEXTS);
    let mut total = SpeculationStats::default();
    compare_all(
        &model,
        &mut CpuBackend::new(&model),
        &prompts,
        48,
        &mut total,
    );
    assert_accepted_and_rejected(&total);
}

#[test]
fn transformers_fixtures_on_cpu_speculate_losslessly() {
    let mut total = SpeculationStats::default();
    for name in ["llama-gqa-untied", "llama-mqa-tied"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        let model = Model::load(&dir).unwrap();
        let v = model.config.vocab_size as u32;
        // Token ids, repeating, within the vocabulary.
        let prompts: Vec<Vec<u32>> = vec![
            (0..12).map(|i| (i % 4 * 7 + 3) % v).collect(),
            (0..9).map(|i| (i * 13 + 5) % v).collect(),
        ];
        compare_all(
            &model,
            &mut CpuBackend::new(&model),
            &prompts,
            40,
            &mut total,
        );
    }
    assert_accepted_and_rejected(&total);
}

#[test]
fn smollm2_on_cpu_speculates_losslessly() {
    let Some(path) = kiln_core::testing::pulled_model("smollm2-135m-instruct") else {
        return;
    };
    let model = Model::load(&path).unwrap();
    let prompts = encode(
        &model,
        &[
            "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.\n\
             The quick brown fox",
            "The capital of France is",
        ],
    );
    let mut backend = CpuBackend::new(&model);
    let stops = model.config.eos_token_ids.clone();
    let mut total = SpeculationStats::default();
    for prompt in &prompts {
        let s = compare(&mut backend, prompt, 24, &stops, 4);
        total.proposed += s.proposed;
        total.accepted += s.accepted;
    }
    println!("smollm2: {total:?}");
    assert_accepted_and_rejected(&total);
}

/// A backend that only prefills and decodes, as a backend without a
/// multi-token step would.
struct OneTokenAtATime<'m>(CpuBackend<'m>);

impl Backend for OneTokenAtATime<'_> {
    fn name(&self) -> &str {
        "one-token"
    }
    fn max_context(&self) -> usize {
        self.0.max_context()
    }
    fn prefill(&mut self, tokens: &[u32]) -> kiln_core::Result<Vec<f32>> {
        self.0.prefill(tokens)
    }
    fn prefill_embeddings(&mut self, embeddings: &[f32]) -> kiln_core::Result<Vec<f32>> {
        self.0.prefill_embeddings(embeddings)
    }
    fn decode(&mut self, token: u32) -> kiln_core::Result<Vec<f32>> {
        self.0.decode(token)
    }
    fn sequence_len(&self) -> usize {
        self.0.sequence_len()
    }
}

#[test]
fn a_backend_without_a_multi_token_step_is_an_error_naming_it() {
    let model = Model::embedded();
    let mut backend = OneTokenAtATime(CpuBackend::new(&model));
    let prompt = model.tokenizer.encode(TEXTS[2]).unwrap();
    let error = generate_speculative(
        &mut backend,
        &mut PromptLookup::default(),
        4,
        &prompt,
        16,
        SamplingParams::default(),
        &[],
        |_| Ok(()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("one-token backend cannot append several tokens"),
        "{error}"
    );
}

#[test]
fn cpu_rewind_drops_positions_and_refuses_to_grow() {
    let model = Model::embedded();
    let mut cpu = CpuBackend::new(&model);
    let prompt = model.tokenizer.encode("abcdef").unwrap();
    let n = prompt.len();
    cpu.prefill(&prompt).unwrap();
    let after_g = cpu.decode(prompt[2]).unwrap();
    let rows = cpu.append(&[1, 2, 3]).unwrap();
    assert_eq!(rows.len(), 3 * model.config.vocab_size);
    assert_eq!(cpu.sequence_len(), n + 4);
    cpu.rewind(n).unwrap();
    assert_eq!(cpu.sequence_len(), n);
    // The rewound sequence continues as if the dropped tokens never came.
    assert_eq!(cpu.decode(prompt[2]).unwrap(), after_g);
    let error = cpu.rewind(n + 5).unwrap_err().to_string();
    assert!(error.contains("cannot rewind to position"), "{error}");
}

/// The benchmark runs end to end on the embedded model: its JSON has a row
/// per K for the prompt that fits, every one with identical tokens.
#[test]
fn the_benchmark_reports_identical_tokens_per_draft_length() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln-bench-speculative"))
        .args(["--model", "embedded", "--max-tokens", "24"])
        .args(["--draft-tokens", "2", "--draft-tokens", "5"])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The passage prompts do not fit the embedded model's 256 positions.
    assert!(stderr.contains("skipped quote"), "{stderr}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    let ks: Vec<u64> = rows
        .iter()
        .map(|r| r["draft_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(ks, [2, 5]);
    for row in rows {
        assert_eq!(row["prompt"], "free");
        assert_eq!(row["identical_tokens"], true, "{row}");
        assert_eq!(row["generated_tokens"], 24, "{row}");
        assert!(row["proposed"].as_u64().unwrap() > 0, "{row}");
    }
}

/// Greedy tokens with a model draft (`ModelDraft` over the CPU reference
/// running `draft`) against plain greedy ones; returns the statistics.
fn compare_with_draft(
    model: &Model,
    draft: &Model,
    prompt: &[u32],
    max_tokens: usize,
    k: usize,
) -> SpeculationStats {
    let mut target = CpuBackend::new(model);
    let stops = model.config.eos_token_ids.clone();
    let plain = generate(
        &mut target,
        prompt,
        max_tokens,
        SamplingParams::default(),
        &stops,
        |_| Ok(()),
    )
    .unwrap();
    let mut proposer = kiln_core::ModelDraft::new("self", Box::new(CpuBackend::new(draft)));
    let (tokens, stats) = generate_speculative(
        &mut target,
        &mut proposer,
        k,
        prompt,
        max_tokens,
        SamplingParams::default(),
        &stops,
        |_| Ok(()),
    )
    .unwrap();
    assert_eq!(tokens, plain, "{} drafting, K {k}", draft.name);
    stats
}

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Model::load(&dir).unwrap()
}

#[test]
fn self_speculation_is_lossless_and_the_whole_model_as_draft_is_always_right() {
    let mut total = SpeculationStats::default();
    for (model, prompts) in [
        (Model::embedded(), encode(&Model::embedded(), &TEXTS)),
        (
            fixture("llama-gqa-untied"),
            vec![
                (0..9).map(|i| (i * 13 + 5) % 64).collect(),
                vec![3, 10, 17, 24, 3, 10],
            ],
        ),
    ] {
        // The whole model drafts exactly what it then chooses: every draft
        // is accepted, which only holds if the draft's cache follows the
        // sequence through every rewind.
        let whole = model.first_layers(model.config.num_layers).unwrap();
        let first = model.first_layers(1).unwrap();
        for prompt in &prompts {
            for k in [1, 4, 7] {
                let s = compare_with_draft(&model, &whole, prompt, 40, k);
                assert!(s.proposed > 0);
                assert_eq!(s.accepted, s.proposed, "K {k}: {s:?}");
                let s = compare_with_draft(&model, &first, prompt, 40, k);
                total.proposed += s.proposed;
                total.accepted += s.accepted;
            }
        }
    }
    println!("first layer drafting: {total:?}");
    assert_accepted_and_rejected(&total);
    let model = Model::embedded();
    let error = model.first_layers(3).err().unwrap().to_string();
    assert!(error.contains("takes 1 to 2 of them, not 3"), "{error}");
}

#[test]
fn smollm2_self_speculation_is_lossless() {
    let Some(path) = kiln_core::testing::pulled_model("smollm2-135m-instruct") else {
        return;
    };
    let model = Model::load(&path).unwrap();
    let draft = model.first_layers(8).unwrap();
    let prompt = model.tokenizer.encode("The capital of France is").unwrap();
    let s = compare_with_draft(&model, &draft, &prompt, 16, 4);
    println!("smollm2, first 8 layers drafting: {s:?}");
    assert_accepted_and_rejected(&s);
}

/// A random Llama over 6 tokens: every joint distribution of a few tokens
/// can be enumerated exactly.
fn tiny_model() -> Model {
    let config = kiln_core::ModelConfig {
        hidden_size: 16,
        intermediate_size: 32,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
        vocab_size: 6,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        max_position_embeddings: 64,
        sliding_window: None,
        qkv_bias: false,
        family: kiln_core::config::Family::Llama,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
    };
    let mut model = Model::random("tiny", config, 7);
    // Sharper logits than ±1/sqrt(16) weights give, so that drafts are
    // neither almost always nor almost never accepted.
    if let Some(head) = model.weights.lm_head.as_mut() {
        head.f32_mut().iter_mut().for_each(|w| *w *= 6.0);
    }
    model
}

/// With sampling, speculative decoding keeps the target's distribution: the
/// joint distribution of 3 tokens sampled with prompt lookup (drafts both
/// accepted and refused) passes a chi-square test against the exact one,
/// enumerated from the model. Accepting every draft, or refusing without
/// redrawing from the rest, fails it.
#[test]
fn speculative_sampling_keeps_the_distribution() {
    let model = tiny_model();
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed,
    };
    let prompt = [1u32, 2, 1, 2, 1];
    let vocab = 6usize;
    let sampler = kiln_core::Sampler::new(sampling(0)).unwrap();
    let mut cpu = CpuBackend::new(&model);
    // Exact P(t1, t2, t3).
    let mut exact = vec![0.0f64; vocab.pow(3)];
    let first = sampler
        .distribution(&cpu.prefill(&prompt).unwrap())
        .unwrap();
    for &(t1, p1) in &first {
        let mut seq = prompt.to_vec();
        seq.push(t1);
        let second = sampler.distribution(&cpu.prefill(&seq).unwrap()).unwrap();
        for &(t2, p2) in &second {
            let mut seq = seq.clone();
            seq.push(t2);
            let third = sampler.distribution(&cpu.prefill(&seq).unwrap()).unwrap();
            for &(t3, p3) in &third {
                exact[(t1 as usize * vocab + t2 as usize) * vocab + t3 as usize] = p1 * p2 * p3;
            }
        }
    }
    let runs = 6000u64;
    let mut counts = vec![0u64; exact.len()];
    let mut total = SpeculationStats::default();
    for seed in 0..runs {
        let (tokens, stats) = generate_speculative(
            &mut cpu,
            &mut PromptLookup::default(),
            2,
            &prompt,
            3,
            sampling(seed),
            &[],
            |_| Ok(()),
        )
        .unwrap();
        counts[(tokens[0] as usize * vocab + tokens[1] as usize) * vocab + tokens[2] as usize] += 1;
        total.proposed += stats.proposed;
        total.accepted += stats.accepted;
    }
    println!("{total:?}");
    assert_accepted_and_rejected(&total);
    // Pool the cells expected fewer than 5 times into one.
    let (mut chi2, mut cells) = (0.0, 0usize);
    let (mut rare_expected, mut rare_seen) = (0.0, 0.0);
    for (p, &n) in exact.iter().zip(&counts) {
        let expected = p * runs as f64;
        if expected < 5.0 {
            rare_expected += expected;
            rare_seen += n as f64;
        } else {
            chi2 += (n as f64 - expected).powi(2) / expected;
            cells += 1;
        }
    }
    if rare_expected > 0.0 {
        chi2 += (rare_seen - rare_expected).powi(2) / rare_expected;
        cells += 1;
    }
    // The 0.001 critical value of chi-square (Wilson-Hilferty).
    let df = (cells - 1) as f64;
    let critical = df * (1.0 - 2.0 / (9.0 * df) + 3.09 * (2.0 / (9.0 * df)).sqrt()).powi(3);
    println!("chi2 {chi2:.1} on {df} degrees of freedom, critical {critical:.1}");
    assert!(
        chi2 < critical,
        "speculative samples do not follow the model's distribution: chi2 {chi2:.1} >= {critical:.1}"
    );
}
