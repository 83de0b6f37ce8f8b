//! Continuous batching on IREE (`local-task`): greedy tokens of requests
//! decoded together in a `BatchedDecoder` — of different prompt lengths and
//! lengths, arriving at different steps, one cancelled midway, more requests
//! than slots — equal each request decoded alone by the batch-1 backend,
//! token for token; sampled slots get their own logits.
//!
//! Needs the `xla-iree` feature, `KILN_IREE_PREFIX` and `KILN_IREE_COMPILE`
//! (`cargo xtask test` sets them up).

use std::collections::VecDeque;
use std::path::PathBuf;

use kiln_core::sampling::argmax;
use kiln_core::{Backend, Model};
use kiln_xla::{
    Admission, BatchedDecoder, Buckets, Choice, Compiler, GraphOptions, IreeBackend, ModuleCache,
    SlotOutput, Target, WeightLayout,
};

const CONTEXT: usize = 64;

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Model::load(&dir).unwrap()
}

fn backend(model: &Model) -> IreeBackend<'_> {
    backend_with(model, GraphOptions::for_target(Target::LlvmCpu, None, None))
}

fn backend_with(model: &Model, graph: GraphOptions) -> IreeBackend<'_> {
    backend_of_context(model, graph, CONTEXT)
}

fn backend_of_context(model: &Model, graph: GraphOptions, context: usize) -> IreeBackend<'_> {
    let compiler = Compiler::from_env().unwrap_or_else(|e| panic!("{e}"));
    IreeBackend::new(
        model,
        "local-task",
        Target::LlvmCpu,
        graph,
        Some(compiler),
        ModuleCache::default_location().unwrap(),
        Buckets::for_model(model, context),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

struct Request {
    prompt: Vec<u32>,
    max_tokens: usize,
    /// The step at which it is queued.
    arrives: usize,
    /// The client leaves after this many tokens.
    cancel_after: Option<usize>,
}

/// Requests of several prompt lengths and lengths, arriving at different
/// steps; more of them than `slots`, so some wait for a slot to free. The
/// first two arrive together with prompts of one length bucket (16 tokens):
/// they are prefilled in one call.
fn requests(model: &Model) -> Vec<Request> {
    let v = model.config.vocab_size as u32;
    let prompt = |n: u32, seed: u32| (0..n).map(|i| (i * seed + 7 * seed) % v).collect();
    vec![
        Request {
            prompt: prompt(5, 13),
            max_tokens: 20,
            arrives: 0,
            cancel_after: None,
        },
        Request {
            prompt: prompt(12, 29),
            max_tokens: 9,
            arrives: 0,
            cancel_after: None,
        },
        Request {
            prompt: prompt(1, 3),
            max_tokens: 30,
            arrives: 2,
            cancel_after: Some(6),
        },
        Request {
            prompt: prompt(40, 5),
            max_tokens: 15,
            arrives: 3,
            cancel_after: None,
        },
        Request {
            prompt: prompt(9, 11),
            max_tokens: 12,
            arrives: 3,
            cancel_after: None,
        },
        Request {
            prompt: prompt(3, 17),
            max_tokens: 25,
            arrives: 7,
            cancel_after: None,
        },
    ]
}

/// Greedy tokens of `prompt` alone, through the batch-1 backend (prefill,
/// host argmax, then the device's greedy decode step).
fn alone(model: &Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut b = backend(model);
    let mut token = argmax(&b.prefill(prompt).unwrap());
    let mut tokens = vec![token];
    while tokens.len() < max_tokens {
        token = b.decode_greedy(token).unwrap();
        tokens.push(token);
    }
    tokens
}

/// Runs `requests` through a decoder of `slots` slots, admitting those that
/// have arrived into free slots together at each step; returns each
/// request's tokens and the largest number of sequences that stepped
/// together.
fn batched(model: &Model, slots: usize, requests: &[Request]) -> (Vec<Vec<u32>>, usize) {
    batched_on(backend(model), slots, requests)
}

/// [`batched`] on a given backend. Asserts that some prompts were prefilled
/// together.
fn batched_on(
    backend: IreeBackend<'_>,
    slots: usize,
    requests: &[Request],
) -> (Vec<Vec<u32>>, usize) {
    let mut decoder = BatchedDecoder::new(backend, slots).unwrap();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut in_slot: Vec<Option<usize>> = vec![None; slots];
    let mut widest = 0;
    let done = |r: &Request, n: usize| n >= r.max_tokens || r.cancel_after.is_some_and(|c| n >= c);
    for step in 0.. {
        queue.extend((0..requests.len()).filter(|&r| requests[r].arrives == step));
        let free = decoder.free_slots();
        let admitted: Vec<(usize, usize)> = queue
            .drain(..free.len().min(queue.len()))
            .zip(free)
            .collect();
        let admissions: Vec<Admission> = admitted
            .iter()
            .map(|&(r, slot)| Admission {
                slot,
                prompt: &requests[r].prompt,
                choice: Choice::Greedy,
            })
            .collect();
        for ((r, slot), logits) in admitted.into_iter().zip(decoder.admit_all(&admissions)) {
            let token = argmax(&logits.unwrap());
            out[r].push(token);
            if done(&requests[r], 1) {
                decoder.release(slot);
            } else {
                decoder.feed(slot, token).unwrap();
                in_slot[slot] = Some(r);
            }
        }
        let outputs = decoder.step().unwrap();
        widest = widest.max(outputs.len());
        for (slot, output) in outputs {
            let r = in_slot[slot].expect("a stepped slot holds a request");
            let SlotOutput::Token(token) = output else {
                panic!("a greedy slot returned logits");
            };
            out[r].push(token);
            if done(&requests[r], out[r].len()) {
                decoder.release(slot);
                in_slot[slot] = None;
            } else {
                decoder.feed(slot, token).unwrap();
            }
        }
        let pending = requests.iter().any(|r| r.arrives > step);
        if !pending && queue.is_empty() && decoder.active() == 0 {
            break;
        }
    }
    assert!(
        decoder.prompts_prefilled_together() >= 2,
        "some prompts were prefilled together"
    );
    (out, widest)
}

fn batching_equals_alone(model: &Model) {
    let requests = requests(model);
    let (together, widest) = batched(model, 4, &requests);
    equal_alone(model, &requests, &together, widest);
}

/// Each request's batched tokens equal its tokens decoded alone, and all 4
/// slots were busy at some step.
fn equal_alone(model: &Model, requests: &[Request], together: &[Vec<u32>], widest: usize) {
    assert_eq!(widest, 4, "the slots were all busy at some step");
    for (r, (request, tokens)) in requests.iter().zip(together).enumerate() {
        let expected_len = request
            .cancel_after
            .unwrap_or(usize::MAX)
            .min(request.max_tokens);
        assert_eq!(tokens.len(), expected_len, "request {r}: length");
        let reference = alone(model, &request.prompt, tokens.len());
        assert_eq!(
            tokens, &reference,
            "request {r}: batched tokens differ from alone"
        );
    }
}

#[test]
fn embedded_model_batched_equals_alone() {
    batching_equals_alone(&Model::embedded());
}

#[test]
fn untied_gqa_fixture_batched_equals_alone() {
    batching_equals_alone(&fixture("llama-gqa-untied"));
}

#[test]
fn tied_mqa_fixture_batched_equals_alone() {
    batching_equals_alone(&fixture("llama-mqa-tied"));
}

/// Qwen2's q/k/v biases in the batched step and the multi-token steps.
#[test]
fn qwen2_fixture_batched_equals_alone() {
    batching_equals_alone(&fixture("qwen2-tied-bias"));
}

/// The batched step with the CUDA target's graph choices (each KV head's
/// query group padded to 8 rows, the norm weights folded into the next
/// matrices, `[out, in]` weights) gives the CPU target's single-sequence
/// tokens.
#[test]
fn cuda_graph_choices_batched_equal_alone() {
    for name in ["llama-gqa-untied", "llama-mqa-tied", "qwen2-tied-bias"] {
        let model = fixture(name);
        let graph = GraphOptions {
            precision: kiln_xla::Precision::F32,
            ..GraphOptions::for_target(Target::Cuda, None, Some(WeightLayout::OutIn))
        };
        let requests = requests(&model);
        let (together, widest) = batched_on(backend_with(&model, graph), 4, &requests);
        equal_alone(&model, &requests, &together, widest);
    }
}

/// The most slots a decoder takes, all busy at once: 40 requests of
/// different lengths on 32 slots, the later ones waiting for a slot.
#[test]
fn thirty_two_slots_batched_equal_alone() {
    let model = Model::embedded();
    let v = model.config.vocab_size as u32;
    let requests: Vec<Request> = (0..40u32)
        .map(|r| Request {
            prompt: (0..1 + r % 7).map(|i| (i * 11 + r * 5 + 1) % v).collect(),
            max_tokens: 4 + (r as usize * 3) % 9,
            arrives: if r < 34 { 0 } else { 2 },
            cancel_after: None,
        })
        .collect();
    let (together, widest) = batched(&model, kiln_xla::MAX_SLOTS, &requests);
    assert_eq!(widest, 32, "every slot stepped together at some step");
    for (r, (request, tokens)) in requests.iter().zip(&together).enumerate() {
        assert_eq!(tokens.len(), request.max_tokens, "request {r}: length");
        let reference = alone(&model, &request.prompt, tokens.len());
        assert_eq!(
            tokens, &reference,
            "request {r}: batched differs from alone"
        );
    }
    let error = BatchedDecoder::new(backend(&model), kiln_xla::MAX_SLOTS + 1)
        .err()
        .expect("more slots than MAX_SLOTS")
        .to_string();
    assert!(error.contains("lower --batch-slots"), "{error}");
}

/// Prompts admitted together — two of the 16-token bucket, three of the
/// 64-token one, in calls whose spare rows repeat a prompt — get the logits
/// of each prompt prefilled alone, and then decode as it does alone; an
/// admission that cannot be made fails alone, naming why, and leaves its
/// slot free.
#[test]
fn prompts_prefilled_together_equal_each_prefilled_alone() {
    let model = fixture("llama-gqa-untied");
    let v = model.config.vocab_size as u32;
    let prompt = |n: u32, seed: u32| -> Vec<u32> { (0..n).map(|i| (i * seed + 3) % v).collect() };
    let prompts = [
        prompt(3, 7),
        prompt(20, 11),
        prompt(10, 13),
        prompt(40, 17),
        prompt(33, 19),
    ];
    let mut decoder = BatchedDecoder::new(backend(&model), 8).unwrap();
    decoder.admit(6, &prompt(2, 5), Choice::Greedy).unwrap();
    let empty: Vec<u32> = Vec::new();
    let outside = vec![1, v];
    let mut admissions: Vec<Admission> = Admission::in_order(&prompts, Choice::Greedy);
    let refused = [
        (6, &prompts[0], "slot 6 is taken"),
        (1, &prompts[0], "slot 1 is admitted twice"),
        (5, &empty, "the prompt is empty"),
        (7, &outside, "outside the vocabulary"),
    ];
    for &(slot, prompt, _) in &refused {
        admissions.push(Admission {
            slot,
            prompt,
            choice: Choice::Greedy,
        });
    }
    let results = decoder.admit_all(&admissions);
    assert_eq!(decoder.prompts_prefilled_together(), 5);
    for (result, (_, _, why)) in results[prompts.len()..].iter().zip(&refused) {
        let error = result.as_ref().expect_err(why).to_string();
        assert!(error.contains(why), "{error}");
    }
    assert_eq!(decoder.free_slots(), vec![5, 7]);
    let mut next = Vec::new();
    for (slot, (prompt, logits)) in prompts.iter().zip(&results).enumerate() {
        let logits = logits.as_ref().unwrap();
        let expected = backend(&model).prefill(prompt).unwrap();
        let diff = kiln_core::testing::max_abs_diff(logits, &expected);
        assert!(diff <= 1e-4, "slot {slot}: logits differ by {diff}");
        next.push(argmax(logits));
        decoder.feed(slot, argmax(logits)).unwrap();
    }
    decoder.release(6);
    let mut chosen: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    for _ in 0..5 {
        for (slot, output) in decoder.step().unwrap() {
            let SlotOutput::Token(token) = output else {
                panic!("a greedy slot returned logits");
            };
            chosen[slot].push(token);
            decoder.feed(slot, token).unwrap();
        }
    }
    for (slot, prompt) in prompts.iter().enumerate() {
        assert_eq!(chosen[slot], alone(&model, prompt, 6), "slot {slot}");
    }
}

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // The command name may hold spaces: the fields after it are counted
    // from its closing parenthesis.
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    after_name.split(' ').nth(7).unwrap().parse().unwrap()
}

/// Steps of 32 busy slots over a context of 256, with every batched module
/// loaded (more than ten modules), reuse the memory of their transient
/// buffers: under 64 page faults a step. Each step allocates and frees several MB of them; when
/// glibc returned those to the system, every step faulted them in again
/// (about 1,700 faults a step, and three times the step time; docs/server.md).
#[test]
fn batched_steps_reuse_their_transient_memory() {
    let model = Model::embedded();
    let graph = GraphOptions::for_target(Target::LlvmCpu, None, None);
    let mut decoder = BatchedDecoder::new(backend_of_context(&model, graph, 256), 32).unwrap();
    decoder.prepare(|_, _| {}).unwrap();
    let prompts: Vec<Vec<u32>> = (0..32u32).map(|s| vec![1 + s % 7, 2, 3]).collect();
    let admissions: Vec<Admission> = Admission::in_order(&prompts, Choice::Greedy);
    for (slot, logits) in decoder.admit_all(&admissions).into_iter().enumerate() {
        decoder.feed(slot, argmax(&logits.unwrap())).unwrap();
    }
    let step = |decoder: &mut BatchedDecoder| {
        for (slot, output) in decoder.step().unwrap() {
            let SlotOutput::Token(token) = output else {
                panic!("a greedy slot returned logits");
            };
            decoder.feed(slot, token).unwrap();
        }
    };
    for _ in 0..8 {
        step(&mut decoder);
    }
    let (before, steps) = (minor_faults(), 32);
    for _ in 0..steps {
        step(&mut decoder);
    }
    let per_step = (minor_faults() - before) / steps;
    println!("{per_step} minor page faults a step");
    assert!(per_step < 64, "{per_step} page faults a step");
}

/// A sampled slot gets its own logits, equal to the batch-1 decode logits
/// of its sequence, while a greedy slot beside it gets its token.
#[test]
fn sampled_slots_get_their_own_logits() {
    let model = Model::embedded();
    let v = model.config.vocab_size as u32;
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..6).map(|i| (i * 7) % v).collect(), vec![3, 1, 4]);
    let mut decoder = BatchedDecoder::new(backend(&model), 4).unwrap();
    let first_a = argmax(&decoder.admit(0, &a, Choice::Sampled).unwrap());
    let first_b = argmax(&decoder.admit(2, &b, Choice::Greedy).unwrap());
    decoder.feed(0, first_a).unwrap();
    decoder.feed(2, first_b).unwrap();
    let outputs = decoder.step().unwrap();
    assert_eq!(outputs.len(), 2);

    let mut single = backend(&model);
    single.prefill(&a).unwrap();
    let expected_a = single.decode(first_a).unwrap();
    single.prefill(&b).unwrap();
    let expected_b = single.decode_greedy(first_b).unwrap();
    match &outputs[0] {
        (0, SlotOutput::Logits(logits)) => {
            let diff = kiln_core::testing::max_abs_diff(logits, &expected_a);
            assert!(diff <= 1e-4, "slot 0 logits differ by {diff}");
        }
        other => panic!("slot 0: {other:?}"),
    }
    assert_eq!(outputs[1], (2, SlotOutput::Token(expected_b)));
}

/// Every slot greedy: each step queues the next before its tokens are
/// read, and the next step uses it when the caller feeds those tokens; a
/// caller that feeds a token of its own gets that token's step (the one
/// queued ahead is dropped), as the batch-1 backend decodes it. A sampled
/// slot or pipelining turned off queues nothing ahead.
#[test]
fn steps_queued_ahead_are_used_or_dropped_as_the_caller_feeds() {
    let model = Model::embedded();
    let v = model.config.vocab_size as u32;
    let prompts = [vec![3, 1, 4, 1, 5], vec![2, 7, 1, 8]];
    let mut decoder = BatchedDecoder::new(backend(&model), 4).unwrap();
    let mut fed: Vec<Vec<u32>> = Vec::new();
    for (slot, prompt) in prompts.iter().enumerate() {
        let first = argmax(&decoder.admit(slot, prompt, Choice::Greedy).unwrap());
        decoder.feed(slot, first).unwrap();
        fed.push(vec![first]);
    }
    assert!(!decoder.queued_ahead(), "nothing stepped yet");
    let mut chosen: Vec<Vec<u32>> = vec![Vec::new(); 2];
    for step in 0..6 {
        for (slot, output) in decoder.step().unwrap() {
            let SlotOutput::Token(token) = output else {
                panic!("a greedy slot returned logits");
            };
            chosen[slot].push(token);
            // At step 2 slot 1 is fed a token of the caller's.
            let next = match (slot, step) {
                (1, 2) => (token + 1) % v,
                _ => token,
            };
            fed[slot].push(next);
            decoder.feed(slot, next).unwrap();
        }
        assert!(decoder.queued_ahead(), "step {step}: every slot is greedy");
    }
    for (slot, prompt) in prompts.iter().enumerate() {
        let mut alone = backend(&model);
        alone.prefill(prompt).unwrap();
        let expected: Vec<u32> = fed[slot][..6]
            .iter()
            .map(|&t| alone.decode_greedy(t).unwrap())
            .collect();
        assert_eq!(chosen[slot], expected, "slot {slot}");
    }

    let mut sampled = BatchedDecoder::new(backend(&model), 4).unwrap();
    let first = argmax(&sampled.admit(0, &prompts[0], Choice::Sampled).unwrap());
    sampled.feed(0, first).unwrap();
    sampled.step().unwrap();
    assert!(
        !sampled.queued_ahead(),
        "a sampled slot waits for its choice"
    );

    let mut unpipelined = backend(&model);
    unpipelined.set_pipelined(false);
    let mut plain = BatchedDecoder::new(unpipelined, 4).unwrap();
    let first = argmax(&plain.admit(0, &prompts[0], Choice::Greedy).unwrap());
    plain.feed(0, first).unwrap();
    plain.step().unwrap();
    assert!(!plain.queued_ahead(), "pipelining is off");
}

/// `kiln-bench-batch` steps every slot of each slot count (or the `--busy`
/// lowest) and reports a step time and tokens/s per count; a backend
/// without a batched step and more busy slots than slots are refused by
/// name.
#[test]
fn the_batched_step_benchmark_runs_and_reports_each_slot_count() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("batch.json");
    let bench = env!("CARGO_BIN_EXE_kiln-bench-batch");
    let out = std::process::Command::new(bench)
        .args([
            "--backend",
            "iree-cpu",
            "--model",
            "embedded",
            "--max-context",
            "64",
        ])
        .args(["--slots", "1", "--slots", "4", "--steps", "8", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 2);
    for (row, slots) in rows.iter().zip([1, 4]) {
        assert_eq!(row["slots"], slots);
        assert_eq!(row["busy"], slots, "every slot busy by default");
        assert!(row["tokens_per_s"].as_f64().unwrap() > 0.0, "{row}");
    }
    // A lone request among four slots, and more busy slots than there are.
    let lone = |busy: &str| {
        std::process::Command::new(bench)
            .args(["--backend", "iree-cpu", "--model", "embedded"])
            .args(["--max-context", "64", "--slots", "4", "--steps", "4"])
            .args(["--busy", busy, "--json"])
            .arg(&json)
            .output()
            .unwrap()
    };
    let out = lone("1");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        (&rows[0]["slots"], &rows[0]["busy"]),
        (&4.into(), &1.into())
    );
    let out = lone("5");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--busy 5 is more than the 4 slots"));
    let out = std::process::Command::new(bench)
        .args(["--backend", "cpu", "--model", "embedded"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("use --backend iree-cpu or iree-cuda"));
}

/// Misuse is an error naming the problem, never a panic.
#[test]
fn misuse_is_a_clear_error() {
    let model = Model::embedded();
    let mut decoder = BatchedDecoder::new(backend(&model), 2).unwrap();
    let error = decoder
        .admit(5, &[1], Choice::Greedy)
        .unwrap_err()
        .to_string();
    assert!(error.contains("slot 5 does not exist"), "{error}");
    decoder.admit(0, &[1, 2], Choice::Greedy).unwrap();
    let error = decoder
        .admit(0, &[1], Choice::Greedy)
        .unwrap_err()
        .to_string();
    assert!(error.contains("slot 0 is taken"), "{error}");
    let error = decoder.feed(1, 1).unwrap_err().to_string();
    assert!(error.contains("slot 1 holds no sequence"), "{error}");
    assert!(
        decoder.feed(0, u32::MAX).is_err(),
        "a token outside the vocabulary"
    );
    assert!(
        decoder.step().unwrap().is_empty(),
        "nothing fed, nothing stepped"
    );
}
