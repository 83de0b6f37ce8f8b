//! Errors of kiln-xla.

use std::path::PathBuf;

use crate::compiler::Target;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "KILN_IREE_COMPILE is unset: it names the pinned iree-compile. \
         Run `cargo xtask compiler` and `eval \"$(cargo xtask env)\"`, or use `nix develop`."
    )]
    CompilerUnset,

    #[error("cannot run iree-compile at {path}: {error}")]
    CompilerRun {
        path: PathBuf,
        error: std::io::Error,
    },

    #[error("{path} --version printed no `VERSION @ REVISION` line:\n{output}")]
    CompilerVersion { path: PathBuf, output: String },

    #[error(
        "iree-compile at {path} is revision {compiler}, but the IREE runtime kiln was built with \
         is revision {runtime}; modules must come from the same revision. Use the pinned compiler \
         (`cargo xtask compiler`, or `nix develop`)."
    )]
    RevisionMismatch {
        compiler: String,
        runtime: String,
        path: PathBuf,
    },

    #[error("iree-compile failed for {target:?}:\n{stderr}")]
    Compile { target: Target, stderr: String },

    #[error("temporary file: {0}")]
    Temp(std::io::Error),

    #[error("module cache: {0}")]
    Cache(String),

    #[error(
        "the module cache folder {dir} is not safe to run modules from: {path} is {why}. \
         Cached modules are native code; use a folder only you can write (set KILN_CACHE_DIR)"
    )]
    CacheUntrusted {
        dir: PathBuf,
        path: PathBuf,
        why: String,
    },

    #[error("cannot identify the host CPU (the module cache key holds it): {0}")]
    HostCpu(String),

    #[error("invalid model config: {0}")]
    Config(String),

    #[error("invalid graph options: {0}")]
    Graph(String),

    #[error(
        "the {module} module is not in the module cache {cache} and no compiler is available \
         (KILN_IREE_COMPILE is unset); run `kiln prepare` where the pinned compiler is, and \
         carry the cache (KILN_CACHE_DIR) here"
    )]
    NotPrepared { module: String, cache: PathBuf },
}

pub type Result<T> = std::result::Result<T, Error>;
