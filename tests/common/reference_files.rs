//! The reference files (`reference_files` in nix/pins.json, unpacked by
//! `cargo xtask test` into KILN_REFERENCE_FILES) as tests read them: a file
//! by name, and a case of llama.cpp's chat-template tests. Shared by
//! tests/released_files.rs and tests/server.rs (`#[path]` modules).
#![allow(dead_code)]

use std::path::PathBuf;

use kiln_core::testing::skip_unless_required;

/// A file of the unpacked reference files, or `None` (saying why) when they
/// are not provided and not required.
pub fn reference_file(name: &str) -> Option<PathBuf> {
    let reason = match std::env::var_os("KILN_REFERENCE_FILES") {
        Some(dir) => {
            let path = PathBuf::from(dir).join(name);
            if path.is_file() {
                return Some(path);
            }
            format!("{} is missing", path.display())
        }
        None => "KILN_REFERENCE_FILES is unset (`cargo xtask test` unpacks the pinned \
                 reference files and sets it)"
            .to_string(),
    };
    skip_unless_required(reason)
}

/// The case of llama.cpp's tests/test-chat-template.cpp that carries
/// Mistral's `v3` template, the one its v3 tokenizer (Mistral 7B v0.3's)
/// ships with; llama.cpp took its copy from Mistral-Large-Instruct-2407.
pub const MISTRAL_V3_TEMPLATE_CASE: &str = "Mistral-Large-Instruct-2407 (mistralai 'v3' template; modified to have system prompt at start)";

/// One case of llama.cpp's tests/test-chat-template.cpp: a released
/// template, the text llama.cpp's Jinja engine must render from it for the
/// file's conversation, and the special tokens it renders with.
pub struct LlamaCppTemplateCase {
    pub template: String,
    pub expected: String,
    pub bos: String,
    pub eos: String,
}

/// The C++ string literals that start `text` (adjacent ones concatenated,
/// as C++ does), unescaped, and what follows them.
fn cpp_string(text: &str) -> (String, &str) {
    let mut out = String::new();
    let mut rest = text.trim_start();
    while let Some(literal) = rest.strip_prefix("u8\"").or(rest.strip_prefix('"')) {
        let mut chars = literal.char_indices();
        let end = loop {
            match chars.next().expect("a string literal ends") {
                (i, '"') => break i,
                (_, '\\') => out.push(match chars.next().unwrap().1 {
                    'n' => '\n',
                    't' => '\t',
                    c @ ('"' | '\\' | '\'') => c,
                    c => panic!("an escape kiln's reader does not know: \\{c}"),
                }),
                (_, c) => out.push(c),
            }
        };
        rest = literal[end + 1..].trim_start();
    }
    (out, rest)
}

/// The case named `name` in llama.cpp's tests/test-chat-template.cpp (the
/// pinned copy), or `None` (saying why) when the reference files are absent.
pub fn llama_cpp_template_case(name: &str) -> Option<LlamaCppTemplateCase> {
    let source = std::fs::read_to_string(reference_file("test-chat-template.cpp")?).unwrap();
    let start = source
        .find(&format!("/* .name= */ \"{name}\""))
        .unwrap_or_else(|| panic!("test-chat-template.cpp has no case {name:?}"));
    let case = &source[start..];
    let field = |field: &str| {
        let marker = format!("/* .{field}= */");
        let at = case.find(&marker).unwrap() + marker.len();
        cpp_string(&case[at..]).0
    };
    let expected = match field("expected_output_jinja") {
        jinja if jinja.is_empty() => field("expected_output"),
        jinja => jinja,
    };
    Some(LlamaCppTemplateCase {
        template: field("template_str"),
        expected,
        bos: field("bos_token"),
        eos: field("eos_token"),
    })
}
