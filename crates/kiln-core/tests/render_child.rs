//! `ChatTemplate::render_isolated` from a process that, like a C `main` or a
//! fuzzer, leaves SIGPIPE at its default (terminate): a renderer that dies
//! before it reads its request must be an error, not the end of the caller.
//! This executable is its own renderer child, so it has its own `main`.

use std::process::ExitCode;

use kiln_core::chat_template::{CHILD_ENV, ChatTemplate, Message, serve_child_if_asked};

/// Set by the checks below in their own environment, which their children
/// inherit: the child exits at once, reading nothing.
const DIE_UNREAD: &str = "KILN_TEST_RENDERER_DIES_UNREAD";
/// The one test's name, as test runners list it.
const NAME: &str = "a_caller_with_sigpipe_at_its_default_survives_its_renderer";

fn main() -> ExitCode {
    if std::env::var_os(DIE_UNREAD).is_some() && std::env::var_os(CHILD_ENV).is_some() {
        return ExitCode::from(3);
    }
    serve_child_if_asked();
    // Listed as libtest lists, for `cargo nextest` (which runs it by name).
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        if !args.iter().any(|a| a == "--ignored") {
            println!("{NAME}: test");
        }
        return ExitCode::SUCCESS;
    }
    // SAFETY: no other thread runs yet; the default action of SIGPIPE is
    // what the checks need.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };

    let template = ChatTemplate::new(
        "test",
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
        "<s>",
        "</s>",
    )
    .expect("a valid template");
    // More than a pipe holds, so a caller writing it to a pipe would block
    // until the child reads, and the child's death would raise SIGPIPE.
    let long = "x".repeat(1 << 20);
    let messages = [Message::new("user", &long)];

    match template.render_isolated(&messages, false) {
        Ok(text) if text == format!("<user>{long}") => {
            println!("ok: a renderer that lives renders the long message")
        }
        other => {
            println!("FAILED: the renderer should render the long message: {other:?}");
            return ExitCode::FAILURE;
        }
    }

    // SAFETY: still the only thread (the render above joined its reader).
    unsafe { std::env::set_var(DIE_UNREAD, "1") };
    match template.render_isolated(&messages, false) {
        Err(e)
            if e.to_string()
                .contains("crashed its renderer (exit status: 3") =>
        {
            println!("ok: a renderer that dies unread is an error")
        }
        other => {
            let shown = format!("{other:?}");
            println!("FAILED: a renderer that dies unread should be an error: {shown:.300}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
