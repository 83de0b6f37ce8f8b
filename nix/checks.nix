# `nix flake check`: each check a thin wrapper around a command that also runs
# without Nix (see the README's table).
{ lib
, pkgs
, craneLib
, src
, packages
, iree-compiler
,
}:
let
  inherit (packages) common cargoArtifacts kiln;
  withArtifacts = common // {
    inherit cargoArtifacts;
  };

  nixFiles = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.fileFilter (file: file.hasExt "nix") ../.;
  };
in
{
  # The link check: every target, release, cuda,xla-iree, nothing run.
  link = craneLib.cargoTest (
    withArtifacts
    // {
      pnameSuffix = "-link";
      cargoTestExtraArgs = "--workspace --all-targets --no-run";
      doInstallCargoArtifacts = false;
    }
  );

  # The gate's self-test: every mutation must fail the link and pass `cargo check`.
  mutations = craneLib.mkCargoDerivation (
    withArtifacts
    // {
      pnameSuffix = "-mutations";
      buildPhaseCargoCommand = "cargo run --release --locked --package xtask -- gate";
      installPhaseCommand = "mkdir -p $out && cp target/gate/report.json $out/";
      doInstallCargoArtifacts = false;
    }
  );

  clippy = craneLib.cargoClippy (
    withArtifacts
    // {
      cargoClippyExtraArgs = "--workspace --all-targets -- --deny warnings";
    }
  );

  rustfmt = craneLib.cargoFmt { inherit src; };

  # The tests on the CPU, xla_prepared_prefill among them (local-task), with
  # modules compiled by the pinned compiler inside the sandbox.
  tests = craneLib.cargoNextest (
    withArtifacts
    // {
      cargoNextestExtraArgs = "--workspace";
      KILN_IREE_COMPILE = lib.getExe iree-compiler;
      preCheck = ''
        export KILN_CACHE_DIR="$TMPDIR/kiln-cache"
      '';
      doInstallCargoArtifacts = false;
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

  # The release binaries built a second time, separately, must be identical
  # (the non-Nix twin: `cargo xtask repro`).
  reproducible =
    let
      again = kiln.overrideAttrs { KILN_REPRODUCIBILITY_BUILD = "second"; };
    in
    pkgs.runCommand "kiln-reproducible" { } ''
      for bin in ${kiln}/bin/*; do
        cmp "$bin" "${again}/bin/$(basename "$bin")"
      done
      touch $out
    '';
}
