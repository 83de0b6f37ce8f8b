# `nix develop`: the toolchain, the CUDA IREE prefix, the compiler, CMake and
# ninja, with the environment `cargo xtask env` prints, so that
# `cargo build --release --features cuda,xla-iree` and `cargo xtask gate` work
# unchanged.
{ lib
, pkgs
, craneLib
, iree-runtime-cuda
, iree-compiler
,
}:
craneLib.devShell {
  packages = [
    pkgs.cmake
    pkgs.ninja
    pkgs.pkg-config
    pkgs.cargo-nextest
    pkgs.nixpkgs-fmt
    pkgs.deadnix
    iree-compiler
  ];
  KILN_IREE_PREFIX = "${iree-runtime-cuda}";
  KILN_IREE_COMPILE = lib.getExe iree-compiler;
  LIBCLANG_PATH = "${lib.getLib pkgs.llvmPackages.libclang}/lib";
}
