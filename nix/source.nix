# Exactly what the Rust build reads: Cargo files and Rust sources, the C shim,
# kiln's CUDA kernels (their PTX is embedded in the binaries), the pin file and the IREE CMake project, the test fixtures. Editing the
# README, the docs, a workflow or a Nix file rebuilds nothing. With
# `forTests`, also what the tests read beyond it (nix/test-data.json: the
# workflows, the CI scripts and the IREE patches that the tests of xtask and
# workflow-lint check).
{ lib
, craneLib
, forTests ? false
,
}:
let
  testData = map (path: ../. + "/${path}") (lib.importJSON ./test-data.json).paths;
in
lib.fileset.toSource {
  root = ../.;
  fileset = lib.fileset.unions (
    [
      (craneLib.fileset.commonCargoSources ../.)
      ../crates/kiln-iree/csrc
      ../crates/kiln-xla/kernels
      ./pins.json
      ./iree-prefix
      ../tests/fixtures
    ]
    ++ lib.optionals forTests testData
  );
}
