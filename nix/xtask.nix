# xtask alone (it needs no IREE): the IREE derivations run its prefix
# installer, the same code `cargo xtask iree` runs. Its source is crane's
# dummy workspace (every crate stubbed; it depends on the Cargo files only)
# with the real crates/xtask and the crates it links, crates/nix-harness,
# crates/workflow-lint and crates/build-support, copied in, so that an edit to kiln's other Rust
# sources rebuilds neither xtask nor IREE (`cargo xtask eval-nix` checks it).
{ lib
, craneLib
, src
,
}:
let
  crateSources = crate: lib.fileset.toSource {
    root = ../crates + "/${crate}";
    fileset = ../crates + "/${crate}";
  };
  common = {
    pname = "kiln-xtask";
    version = (lib.importTOML ../Cargo.toml).workspace.package.version;
    strictDeps = true;
    cargoExtraArgs = "--locked --package xtask";
    cargoVendorDir = craneLib.vendorCargoDeps { cargoLock = ../Cargo.lock; };
  };
in
craneLib.buildPackage (
  common
    // {
    src = craneLib.mkDummySrc {
      inherit src;
      extraDummyScript = ''
        rm -rf $out/crates/xtask $out/crates/nix-harness $out/crates/workflow-lint $out/crates/build-support
        cp -r --no-preserve=mode ${crateSources "xtask"} $out/crates/xtask
        cp -r --no-preserve=mode ${crateSources "nix-harness"} $out/crates/nix-harness
        cp -r --no-preserve=mode ${crateSources "workflow-lint"} $out/crates/workflow-lint
        cp -r --no-preserve=mode ${crateSources "build-support"} $out/crates/build-support
      '';
    };
    cargoArtifacts = craneLib.buildDepsOnly (common // { inherit src; });
    doCheck = false;
    meta.mainProgram = "xtask";
  }
)
