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
    # libclang for bindgen, and clang arguments that find Nix's headers.
    pkgs.rustPlatform.bindgenHook
    pkgs.cargo-nextest
    pkgs.nixpkgs-fmt
    pkgs.deadnix
    iree-compiler
  ];
  KILN_IREE_PREFIX = "${iree-runtime-cuda}";
  KILN_IREE_COMPILE = lib.getExe iree-compiler;
  # IREE's CUDA driver dlopens libcuda.so, which comes with the host's
  # driver; outside NixOS Nix's glibc would not find it. The same script as
  # the `kiln` wrappers' (it says why only a link to the driver goes on
  # LD_LIBRARY_PATH, never the host's library folder).
  shellHook = ''
    . ${./host-cuda-driver.sh}
  '';
}
