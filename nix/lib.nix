# Pure functions over the pin file: everything here evaluates with nixpkgs'
# `lib` alone, so it can be checked without building anything.
{ lib }:
let
  pins = lib.importJSON ./pins.json;

  minimumCudaFor = pins.cuda.minimum_version_for_capability;
in
rec {
  inherit pins;

  # The entry of a per-system table of the pin file, or an evaluation error
  # that names what is missing.
  forSystem =
    what: table: system:
      table.${system} or (throw "nix/pins.json pins no ${what} for ${system}; add one to build there");

  # A pinned download as fetchurl arguments; `name` is overridable because
  # unpackPhase recognises archives by their name.
  fetchArgs = pin: {
    inherit (pin) url sha256;
    name = pin.name;
  };

  # IREE's CMake options for the CPU-only (`cuda = false`) or CUDA variant.
  cmakeFlags =
    cuda:
    lib.mapAttrsToList (name: value: "-D${name}=${value}") (
      pins.iree.cmake_options.common // lib.optionalAttrs cuda pins.iree.cmake_options.cuda
    );

  # "X.Y" -> "cudaPackages_X_Y".
  cudaPackagesAttr = "cudaPackages_" + lib.replaceStrings [ "." ] [ "_" ] pins.cuda.version;

  # `capabilities`, or an evaluation error if CUDA `version` cannot target
  # one of them.
  checkCapabilities =
    version: capabilities:
    let
      unsupported = lib.filter
        (
          capability:
          !(minimumCudaFor ? ${capability}) || lib.versionOlder version minimumCudaFor.${capability}
        )
        capabilities;
      explain =
        capability:
        if minimumCudaFor ? ${capability} then
          "${capability} needs CUDA >= ${minimumCudaFor.${capability}}"
        else
          "${capability} is not in cuda.minimum_version_for_capability";
    in
    if unsupported == [ ] then
      capabilities
    else
      throw (
        "CUDA ${version} (nix/pins.json) cannot target every requested capability: "
        + lib.concatMapStringsSep ", " explain unsupported
        + ". Move cuda.version in nix/pins.json."
      );

  # The pinned capabilities, checked against the pinned CUDA.
  cudaCapabilities = checkCapabilities pins.cuda.version pins.cuda.capabilities;

  # Accepts free licences and NVIDIA's CUDA licences, nothing else unfree.
  allowCudaLicences =
    pkg:
    lib.all
      (
        license:
        (license.free or false)
        || lib.elem (license.shortName or "") [
          "CUDA EULA"
          "cuDNN EULA"
          "cuTENSOR EULA"
        ]
      )
      (lib.toList (pkg.meta.license or [ ]));
}
