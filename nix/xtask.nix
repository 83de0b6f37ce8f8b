# xtask alone (it needs no IREE): the IREE derivations run its prefix
# installer, the same code `cargo xtask iree` runs. Its source is crane's
# dummy workspace (every crate stubbed; it depends on the Cargo files only)
# with the real crates/xtask copied in, so that an edit to kiln's other Rust
# sources rebuilds neither xtask nor IREE (`cargo xtask eval-nix` checks it).
{ lib
, craneLib
, src
,
}:
let
  xtaskSources = lib.fileset.toSource {
    root = ../crates/xtask;
    fileset = ../crates/xtask;
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
        rm -rf $out/crates/xtask
        cp -r --no-preserve=mode ${xtaskSources} $out/crates/xtask
      '';
    };
    cargoArtifacts = craneLib.buildDepsOnly (common // { inherit src; });
    doCheck = false;
    meta.mainProgram = "xtask";
  }
)
