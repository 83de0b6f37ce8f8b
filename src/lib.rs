//! The `kiln` package: the CLI (`src/main.rs`), the benchmarks (`src/bin/`),
//! and what they share.

pub mod backends;
pub mod bench;
pub mod chat;
pub mod pull;
pub mod server;
pub mod speculation;
mod text_out;

pub use text_out::print_text;
