# The IREE runtime built from the pinned source into a prefix, exactly as
# `cargo xtask iree [--cuda]` builds it: the same CMake project
# (nix/iree-prefix), the same options (nix/pins.json) and the same installer
# (`xtask iree-prefix-install`), so both give the same layout and link
# description.
{ lib
, stdenv
, fetchurl
, runCommand
, cmake
, ninja
, cudaPackages
, kilnLib
, xtask
, cuda ? false
,
}:
let
  inherit (kilnLib) pins;

  # IREE_CUDA_DEPS_DIR: cuda.h, nvcc's crt headers, CCCL's nv headers and
  # libdevice — what the CUDA HAL driver compiles against (no nvcc run, no
  # libcuda linked).
  # The same CUDA as the wheels `cargo xtask iree --cuda` uses: nixpkgs'
  # packages at exactly the pinned versions.
  versionMismatches = lib.filter (wheel: cudaPackages.${wheel.nixpkgs}.version != wheel.version) (
    lib.attrValues pins.cuda.wheels
  );
  cudaDeps =
    assert lib.assertMsg (cudaPackages.cudaMajorMinorVersion == pins.cuda.version)
      "cudaPackages is CUDA ${cudaPackages.cudaMajorMinorVersion}, nix/pins.json pins ${pins.cuda.version}";
    assert lib.assertMsg (versionMismatches == [ ])
      (
        "nixpkgs' CUDA packages are not the versions nix/pins.json pins: "
        + lib.concatMapStringsSep ", "
          (wheel: "${wheel.nixpkgs} is ${cudaPackages.${wheel.nixpkgs}.version}, the pin ${wheel.version}")
          versionMismatches
        + ". Move the wheels in nix/pins.json to nixpkgs' versions (or the nixpkgs input)."
      );
    runCommand "iree-cuda-deps-${cudaPackages.cudaMajorMinorVersion}" { } ''
      mkdir -p $out/include $out/nvvm/libdevice
      for dir in \
        ${lib.getInclude cudaPackages.cuda_cudart}/include \
        ${lib.getInclude cudaPackages.cuda_nvcc}/include \
        ${lib.getInclude cudaPackages.cuda_cccl}/include; do
        cp -rL --no-preserve=mode "$dir"/. $out/include/
      done
      cp -L ${lib.getBin cudaPackages.cuda_nvcc}/nvvm/libdevice/libdevice.10.bc $out/nvvm/libdevice/
      for file in include/cuda.h include/crt/host_config.h include/nv/target nvvm/libdevice/libdevice.10.bc; do
        test -e "$out/$file" || { echo "IREE_CUDA_DEPS_DIR lacks $file" >&2; exit 1; }
      done
    '';
in
stdenv.mkDerivation (
  {
    pname = if cuda then "iree-runtime-cuda" else "iree-runtime";
    inherit (pins.iree) version;

    # The crate is a gzip tarball; the name tells unpackPhase so.
    src = fetchurl (kilnLib.fetchArgs pins.iree.source // { name = "iree-source.tar.gz"; });
    sourceRoot = pins.iree.source.subdir;

    # kiln's patches (nix/iree-patches, each saying why), in name order, as
    # `cargo xtask iree` applies them: `patch -p1` in the source root. The
    # pinned hash above covers the unpatched tarball.
    patches = map (name: ./iree-patches + "/${name}") (
      lib.sort lib.lessThan (
        lib.filter (lib.hasSuffix ".patch") (lib.attrNames (builtins.readDir ./iree-patches))
      )
    );

    nativeBuildInputs = [
      cmake
      ninja
      xtask
    ];

    # The project is nix/iree-prefix, with this source as a subproject.
    dontUseCmakeConfigure = true;
    configurePhase = ''
      runHook preConfigure
      # The installer reads the link probe's link line from CMake's file API.
      mkdir -p build/.cmake/api/v1/query
      touch build/.cmake/api/v1/query/codemodel-v2
      cmake -G Ninja -S ${./iree-prefix} -B build -DKILN_IREE_SOURCE_DIR="$PWD" \
        ${lib.escapeShellArgs (kilnLib.cmakeFlags cuda)}
      runHook postConfigure
    '';

    buildPhase = ''
      runHook preBuild
      # The code generators too: the installer puts them in bin/ (xtask's
      # prefix::HOST_TOOLS), as `cargo xtask iree` does for host builds.
      ninja -C build -j "$NIX_BUILD_CORES" kiln_iree_link_probe iree-flatcc-cli iree-c-embed-data
      runHook postBuild
    '';

    # The probe must create a session on the CPU driver before it is a prefix.
    doCheck = true;
    checkPhase = ''
      runHook preCheck
      build/kiln_iree_link_probe local-sync
      runHook postCheck
    '';

    installPhase = ''
      runHook preInstall
      xtask iree-prefix-install --build build --source "$PWD" --out "$out" --pins ${./pins.json}
      runHook postInstall
    '';

    meta = {
      description = "IREE ${pins.iree.version} runtime prefix for kiln${lib.optionalString cuda " (CUDA HAL driver)"}";
      platforms = [
        "x86_64-linux"
        "aarch64-linux"
      ];
    };
  }
    // lib.optionalAttrs cuda {
    env.IREE_CUDA_DEPS_DIR = "${cudaDeps}";
    passthru = { inherit cudaDeps; };
  }
)
