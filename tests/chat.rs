//! `kiln chat` as a user meets it, on a model folder with SmolLM2's ChatML
//! template whose scripted weights answer "Hi" and end the turn.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use kiln_core::testing::chatml_model;

/// SmolLM2-135M-Instruct's chat template.
const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// `kiln chat` on the f32 reference: the scripted models' weights are their
/// program, run as written (chat's default, cpu-q4, would round them).
fn kiln_chat(model: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    kiln_chat_on(&["--backend", "cpu"], model, args, stdin)
}

fn kiln_chat_on(backend: &[&str], model: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("chat")
        .args(backend)
        .arg("--model")
        .arg(model)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn one_question_is_answered_until_the_end_of_turn() {
    let dir = tempfile::tempdir().unwrap();
    chatml_model(dir.path(), Some(SMOLLM2)).unwrap();
    let out = kiln_chat(
        dir.path(),
        &["--show-prompt", "What is the capital of France?"],
        None,
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Without the stop at <|im_end|> the model would go on: "Hi!!!!…".
    assert_eq!(text(&out.stdout), "Hi\n");
    assert!(stderr.contains("3 generated"), "{stderr}");
    assert!(stderr.contains("end of turn"), "{stderr}");
    assert!(
        stderr.starts_with(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
             <|im_start|>assistant\n[end of prompt]\n"
        ),
        "{stderr}"
    );
}

#[test]
fn piped_lines_are_turns_of_one_conversation() {
    let dir = tempfile::tempdir().unwrap();
    chatml_model(dir.path(), Some(SMOLLM2)).unwrap();
    let out = kiln_chat(
        dir.path(),
        &["--show-prompt", "--system", "Be brief."],
        Some("Hello\n\nAnd again?\n"),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(text(&out.stdout), "Hi\nHi\n");
    // The second prompt holds the first exchange; the empty line is no turn.
    assert!(
        stderr.contains(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
             <|im_start|>assistant\nHi<|im_end|>\n<|im_start|>user\nAnd again?<|im_end|>\n\
             <|im_start|>assistant\n[end of prompt]"
        ),
        "{stderr}"
    );
}

#[test]
fn template_problems_are_clear_errors() {
    let cases = [
        (Some("{% for m in messages %}"), "tokenizer_config.json"),
        (
            Some("{{ raise_exception('no system messages, please') }}"),
            "no system messages, please",
        ),
        (None, "has no chat template"),
    ];
    for (template, expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        chatml_model(dir.path(), template).unwrap();
        let out = kiln_chat(dir.path(), &["Hi"], None);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{template:?}");
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(stderr.contains(expected), "{expected}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// On a terminal: a prompt per turn, history kept, Ctrl-D ends. The
/// terminal is a pseudo-terminal from util-linux `script`.
#[test]
fn a_terminal_gets_a_conversation_that_ctrl_d_ends() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: util-linux `script` (to get a pseudo-terminal) is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    chatml_model(dir.path(), Some(SMOLLM2)).unwrap();
    let command = format!(
        "'{}' chat --backend cpu --show-prompt --model '{}'",
        env!("CARGO_BIN_EXE_kiln"),
        dir.path().display()
    );
    let mut child = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Two turns, then Ctrl-D (EOT) at the start of a line.
    let mut input = child.stdin.take().unwrap();
    input.write_all(b"Hello\nAgain\n\x04").unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    let screen = text(&out.stdout).replace('\r', "");
    assert!(out.status.success(), "{screen}");
    assert!(screen.contains("Ctrl-D ends."), "{screen}");
    assert_eq!(screen.matches("> ").count(), 3, "{screen}");
    assert_eq!(
        screen.matches("[end of prompt]\nHi\n").count(),
        2,
        "{screen}"
    );
    assert!(
        screen.contains("<|im_start|>assistant\nHi<|im_end|>\n<|im_start|>user\nAgain<|im_end|>"),
        "{screen}"
    );
    assert!(screen.ends_with("> \n"), "{screen}");
}

/// chat's default backend is `auto`, which keeps the model's precision: a
/// model stored in f16 runs on cpu-simd at f16 (it was rounded to 4 bits by
/// cpu-q4 unasked), and the line saying so names the way to cpu-q4. Asked
/// for, cpu-q4 refuses a model whose rows are not whole 32-weight blocks
/// with what to pass instead, never running another backend unasked.
#[test]
fn chat_keeps_the_models_precision_by_default_and_names_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    chatml_model(dir.path(), Some(SMOLLM2)).unwrap();
    let out = kiln_chat_on(&[], dir.path(), &["Hello"], None);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        // (A CUDA build says first that no GPU answered.)
        stderr.contains("kiln: backend auto: cpu-simd (")
            && stderr.contains("the model's matrices are f16, which cpu-simd keeps as stored")
            && stderr.contains("`--backend cpu-q4` rounds them to 4 bits"),
        "{stderr}"
    );
    let out = kiln_chat_on(&["--backend", "cpu-q4"], dir.path(), &["Hello"], None);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cpu-q4 backend cannot store layer 0 q/k/v")
            && stderr.contains("not a whole number of 32-input blocks")
            && stderr.contains("--backend cpu"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}
