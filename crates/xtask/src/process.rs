//! The one way xtask runs a program: build-support's (`run`, `read`,
//! `output`, `logged`, …), and what is xtask's own: [`cargo`], the cargo
//! that runs xtask, and [`target_dir`], where its builds go.

use std::path::PathBuf;
use std::process::Command;

pub use build_support::process::{logged, output_text, read, read_bytes, run};

use crate::pins::repo_root;

/// The cargo that runs xtask (`$CARGO`), else the one on PATH.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// The target folder cargo uses here: `CARGO_TARGET_DIR` (relative to where
/// xtask runs, as cargo reads it; crane sets `target`), else the checkout's.
/// Before the first build it may not exist.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => std::path::absolute(&dir).unwrap_or_else(|_| dir.into()),
        None => repo_root().join("target"),
    }
}
