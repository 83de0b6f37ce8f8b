//! The plumbing under kiln's build tasks (`cargo xtask`), generic but for
//! its messages: running a program ([`process`]), every sha256 ([`digest`]), a
//! download streamed and hashed ([`download`]), archives unpacked
//! ([`unpack`]), the checkout's files and copies of them ([`tree`]). What is
//! kiln's — which inputs are pinned, where the cache is, what a step or the
//! gate runs — stays in xtask.

pub mod digest;
pub mod download;
pub mod process;
pub mod tree;
pub mod unpack;
