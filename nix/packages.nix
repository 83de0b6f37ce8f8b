# crane's builds of kiln: the dependency artifacts every check reuses, and
# the release binaries.
{ lib
, pkgs
, craneLib
, src
, iree-runtime-cuda
,
}:
let
  version = (lib.importTOML ../Cargo.toml).workspace.package.version;

  # What every cuda,xla-iree build of the dependencies shares.
  depsCommon = {
    inherit src version;
    pname = "kiln";
    strictDeps = true;
    nativeBuildInputs = [
      pkgs.pkg-config
      pkgs.rustPlatform.bindgenHook
    ];
    cargoExtraArgs = "--locked --features cuda,xla-iree";
    # bindgenHook passes clang a seed taken from the output path unless this
    # is fixed; fixed, the final builds reuse the dependency artifacts.
    NIX_OUTPATH_USED_AS_RANDOM_SEED = "kilnkilnki";
  };

  # The dependencies need no IREE (only kiln-iree's build script reads the
  # prefix), so a new prefix does not rebuild them.
  cargoArtifacts = craneLib.buildDepsOnly depsCommon;

  # What every build of kiln's own crates shares.
  common = depsCommon // {
    KILN_IREE_PREFIX = "${iree-runtime-cuda}";
  };
in
{
  inherit common cargoArtifacts;

  # kiln's release binaries. The driver's library folder goes into their
  # runpath, so the CUDA driver's dlopen("libcuda.so") works on NixOS.
  kiln = craneLib.buildPackage (
    common
    // {
      inherit cargoArtifacts;
      cargoExtraArgs = "${common.cargoExtraArgs} --package kiln";
      doCheck = false;
      nativeBuildInputs = common.nativeBuildInputs ++ [ pkgs.autoAddDriverRunpath ];
      meta.mainProgram = "kiln";
    }
  );
}
