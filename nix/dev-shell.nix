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
  # IREE's CUDA driver dlopens libcuda.so (that exact name), which comes
  # with the host's driver. Nix's glibc does not read the host's /etc/ld.so.cache, so
  # binaries built here would not find it: put the driver's folder (NixOS's
  # /run/opengl-driver/lib, or wherever the host's ldconfig knows libcuda.so
  # from) on LD_LIBRARY_PATH.
  shellHook = ''
    for kiln_dir in /run/opengl-driver/lib \
      $(/sbin/ldconfig -p 2>/dev/null | sed -n 's|.*libcuda\.so.* => \(.*\)/[^/]*$|\1|p' | sort -u); do
      if [ -e "$kiln_dir/libcuda.so" ]; then
        export LD_LIBRARY_PATH="$kiln_dir''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        break
      fi
    done
    unset kiln_dir
  '';
}
