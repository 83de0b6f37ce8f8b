# Exactly what the Rust build reads: Cargo files and Rust sources, the C shim,
# the pin file and the IREE CMake project, the test fixtures. Editing the
# README, the docs, a workflow or a Nix file rebuilds nothing.
{ lib, craneLib }:
lib.fileset.toSource {
  root = ../.;
  fileset = lib.fileset.unions [
    (craneLib.fileset.commonCargoSources ../.)
    ../crates/kiln-iree/csrc
    ./pins.json
    ./iree-prefix
    ../tests/fixtures
  ];
}
