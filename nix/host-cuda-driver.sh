# shellcheck shell=bash
# Sourced by the `kiln` wrappers (`nix run`, `nix build`) and `nix develop`:
# lets IREE's CUDA driver find the host's NVIDIA driver library outside NixOS.
#
# IREE dlopens the exact name `libcuda.so`. Nix's glibc does not read the
# host's /etc/ld.so.cache, and the binaries' runpath names only NixOS's
# /run/opengl-driver/lib, so on Ubuntu or DGX OS the driver is not found. The
# host's driver folder cannot go on LD_LIBRARY_PATH as it is: it is often
# /usr/lib/<triple>, which also holds the host's libc and libstdc++, and
# LD_LIBRARY_PATH comes before the runpath, so the binary would load the
# host's libc with Nix's loader. Instead, a folder of kiln's own holds one
# link, `libcuda.so`, to the host's driver, and only that folder goes on
# LD_LIBRARY_PATH.
#
# KILN_CUDA_DRIVER_DIRS (colon-separated) replaces the folders searched: the
# host's ldconfig cache, then the usual driver folders.

kiln_find_host_cuda_driver() {
  local dir dirs
  if [ -n "${KILN_CUDA_DRIVER_DIRS:-}" ]; then
    dirs=${KILN_CUDA_DRIVER_DIRS//:/ }
  else
    # NixOS: the runpath already has it.
    if [ -e /run/opengl-driver/lib/libcuda.so ]; then
      return 1
    fi
    dirs="$( { /sbin/ldconfig -p || ldconfig -p; } 2>/dev/null |
      sed -n 's|.*libcuda\.so[.0-9]* .*=> \(.*\)/[^/]*$|\1|p' | sort -u | tr '\n' ' ')"
    dirs="$dirs /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/lib/wsl/lib"
  fi
  for dir in $dirs; do
    for lib in "$dir/libcuda.so.1" "$dir/libcuda.so"; do
      if [ -e "$lib" ]; then
        printf '%s\n' "$lib"
        return 0
      fi
    done
  done
  return 1
}

kiln_expose_host_cuda_driver() {
  local lib folder
  lib="$(kiln_find_host_cuda_driver)" || return 0
  folder="${KILN_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-}/.cache}/kiln}/host-cuda-driver"
  (umask 077 && mkdir -p "$folder") 2>/dev/null || return 0
  # A new link under a name of this process's, then renamed over the old one:
  # a kiln starting at the same moment never sees a missing or half-made link.
  ln -sfn "$lib" "$folder/.libcuda.so.$$" &&
    mv -Tf "$folder/.libcuda.so.$$" "$folder/libcuda.so" || return 0
  export LD_LIBRARY_PATH="$folder${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

kiln_expose_host_cuda_driver
unset -f kiln_find_host_cuda_driver kiln_expose_host_cuda_driver
