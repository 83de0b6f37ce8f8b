# xtask alone (it needs no IREE): the IREE derivations run its prefix
# installer, the same code `cargo xtask iree` runs.
{ lib
, craneLib
, src
,
}:
craneLib.buildPackage {
  inherit src;
  pname = "kiln-xtask";
  version = (lib.importTOML ../Cargo.toml).workspace.package.version;
  strictDeps = true;
  cargoExtraArgs = "--locked --package xtask";
  doCheck = false;
  meta.mainProgram = "xtask";
}
