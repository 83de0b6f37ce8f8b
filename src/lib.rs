//! The `kiln` package: the CLI (`src/main.rs`), the benchmarks (`src/bin/`),
//! and what they share.

pub mod backends;
pub mod pull;
