# `nix flake check`: each check a thin wrapper around a command that also runs
# without Nix (see the table in docs/nix.md).
{ lib
, pkgs
, craneLib
, src
, testSrc
, packages
, iree-compiler
, xtask
, models
, reference-files
,
}:
let
  inherit (packages) common cargoArtifacts cpu;
  withArtifacts = common // {
    inherit cargoArtifacts;
  };

  # Every failure in one run, not only the first.
  nextestArgs.cargoNextestExtraArgs = "--workspace --no-fail-fast";
  # The tests read more than the build (nix/test-data.json); the dependency
  # artifacts are the same, as they are built from the Cargo files alone.
  # They get every outside input `cargo xtask test` gives them — the pinned
  # model in the cache, the released files, a Python with Jinja2 — and, as
  # in CI, KILN_REQUIRE_MODELS=1 turns a test that would skip for lack of
  # one into a failure.
  testEnv = {
    src = testSrc;
    KILN_IREE_COMPILE = lib.getExe iree-compiler;
    KILN_REFERENCE_FILES = reference-files;
    KILN_JINJA_PYTHON = "${pkgs.python3.withPackages (ps: [ ps.jinja2 ])}/bin/python3";
    KILN_REQUIRE_MODELS = "1";
    preCheck = ''
      export KILN_CACHE_DIR="$TMPDIR/kiln-cache"
      mkdir -p "$KILN_CACHE_DIR/models"
      ln -s ${models.smollm2-135m-instruct} "$KILN_CACHE_DIR/models/smollm2-135m-instruct.gguf"
    '';
    doInstallCargoArtifacts = false;
  };

  nixFiles = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.fileFilter (file: file.hasExt "nix") ../.;
  };
in
{
  # The link check: every target, release, cuda,xla-iree, nothing run.
  # (crane's cargoTest would name it kiln-test: it sets its own suffix.)
  link = craneLib.mkCargoDerivation (
    withArtifacts
    // {
      pnameSuffix = "-link";
      buildPhaseCargoCommand = "cargoWithProfile test ${common.cargoExtraArgs} --workspace --all-targets --no-run";
      doInstallCargoArtifacts = false;
    }
  );

  # The gate's self-test: every mutation must fail the link and pass `cargo check`.
  mutations = craneLib.mkCargoDerivation (
    withArtifacts
    // {
      pnameSuffix = "-mutations";
      # The gate writes its report into $out itself: its file name is the
      # gate's business (report-TRIPLE.json), not this check's.
      buildPhaseCargoCommand = "cargo run --release --locked --package xtask -- gate --out $out";
      doInstallCargoArtifacts = false;
    }
  );

  clippy = craneLib.cargoClippy (
    withArtifacts
    // {
      cargoClippyExtraArgs = "--workspace --all-targets -- --deny warnings";
      doInstallCargoArtifacts = false;
    }
  );

  rustfmt = craneLib.cargoFmt {
    inherit src;
    doInstallCargoArtifacts = false;
  };

  # The tests on the CPU, xla_prepared_prefill among them (local-task), with
  # modules compiled by the pinned compiler inside the sandbox: with
  # cuda,xla-iree against the CUDA prefix, and with the default features
  # against the CPU-only prefix, as `cargo xtask test` runs them.
  tests = craneLib.cargoNextest (withArtifacts // testEnv // nextestArgs);
  tests-cpu = craneLib.cargoNextest (
    cpu
    // testEnv
    // nextestArgs
    // {
      pname = "kiln-cpu";
    }
  );

  # The doctests, which nextest does not run.
  doctests = craneLib.cargoDocTest (
    cpu
    // testEnv
    // {
      cargoTestExtraArgs = "--workspace";
    }
  );

  # Every Nix file formatted (nixpkgs-fmt) and free of dead code (deadnix).
  nix-lint =
    pkgs.runCommand "kiln-nix-lint"
      {
        nativeBuildInputs = [
          pkgs.nixpkgs-fmt
          pkgs.deadnix
        ];
      }
      ''
        cd ${nixFiles}
        nixpkgs-fmt --check $(find . -name '*.nix')
        deadnix --fail $(find . -name '*.nix')
        touch $out
      '';

  # "sm_121" as a property of kiln's kernels: every module kiln prepares for
  # its embedded model and TinyLlama's shape, and kiln's own kernels'
  # committed PTX, assembled by the pinned CUDA's ptxas for each pinned
  # capability (the twin: `cargo xtask ptxas`).
  ptxas = pkgs.runCommand "kiln-ptxas" { nativeBuildInputs = [ xtask ]; } ''
    xtask ptxas --pins ${./pins.json} --out $out \
      --bench ${packages.kiln-unwrapped}/bin/kiln-bench-decode \
      --compiler ${lib.getExe iree-compiler} \
      --ptxas ${lib.getBin pkgs.cudaPackages.cuda_nvcc}/bin/ptxas \
      --kernels ${../crates/kiln-xla/kernels}
  '';

  # The release binaries built a second time, sharing nothing with the first
  # build (dependencies, source folder, seed), must be identical (the non-Nix
  # twin: `cargo xtask repro`).
  reproducible = pkgs.runCommand "kiln-reproducible" { } ''
    for bin in ${packages.kiln-unwrapped}/bin/*; do
      cmp "$bin" "${packages.kiln-again}/bin/$(basename "$bin")"
    done
    touch $out
  '';
}
