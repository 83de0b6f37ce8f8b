//! Chat templates, as a model file ships them, rendered as the server
//! renders them (in a child process, with its limits): any template and
//! conversation is a bounded prompt or an error, never a panic, an abort, a
//! hang or a stack overflow of the fuzzer's process. The input is the
//! template, then a NUL, then the user's message. The child is this fuzzer
//! executable, which renders and exits when asked in its environment.
#![no_main]

use kiln_core::chat_template::{ChatTemplate, MAX_RENDERED_BYTES, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: {
    kiln_core::chat_template::serve_child_if_asked();
    // A fuzzer whose children cannot render would test nothing: the child
    // must start and render a plain template under its limits.
    let plain = ChatTemplate::new("fuzz", "{{ messages[0].content }}", "<s>", "</s>")
        .expect("a plain template");
    let rendered = plain.render_isolated(&[Message::new("user", "hi")], false);
    assert_eq!(rendered.expect("the renderer child works"), "hi");
}, |data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (source, content) = text.split_once('\0').unwrap_or((text, "hi"));
    let Ok(template) = ChatTemplate::new("fuzz", source, "<s>", "</s>") else {
        return;
    };
    let messages = [
        Message::new("system", "You are kind."),
        Message::new("user", content),
    ];
    if let Ok(prompt) = template.render_isolated(&messages, true) {
        assert!(prompt.len() <= MAX_RENDERED_BYTES);
    }
});
