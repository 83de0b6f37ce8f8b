# crane with the Rust toolchain of rust-toolchain.toml (the same file rustup
# reads), through rust-overlay.
{ pkgs, crane }:
(crane.mkLib pkgs).overrideToolchain (p: p.rust-bin.fromRustupToolchainFile ../rust-toolchain.toml)
