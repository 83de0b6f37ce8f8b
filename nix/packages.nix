# crane's builds of kiln: the dependency artifacts the checks reuse, and the
# release binaries.
{ lib
, pkgs
, craneLib
, src
, iree-runtime
, iree-runtime-cuda
, iree-compiler
,
}:
let
  version = (lib.importTOML ../Cargo.toml).workspace.package.version;

  # What every build of kiln's dependencies shares. They need no IREE (only
  # kiln-iree's build script reads the prefix), so a new prefix does not
  # rebuild them.
  depsArgs = cargoExtraArgs: {
    inherit src version cargoExtraArgs;
    pname = "kiln";
    strictDeps = true;
    nativeBuildInputs = [
      pkgs.pkg-config
      pkgs.rustPlatform.bindgenHook
    ];
    # bindgenHook passes clang a seed taken from the output path unless this
    # is fixed; fixed, the final builds reuse the dependency artifacts.
    NIX_OUTPATH_USED_AS_RANDOM_SEED = "kilnkilnki";
  };

  # The release cuda,xla-iree build (the gate's, the binaries').
  depsCommon = depsArgs "--locked --features cuda,xla-iree";
  cargoArtifacts = craneLib.buildDepsOnly depsCommon;
  common = depsCommon // {
    KILN_IREE_PREFIX = "${iree-runtime-cuda}";
  };

  # Default features against the CPU-only prefix: the first test run of
  # `cargo xtask test`.
  cpuDeps = depsArgs "--locked";
  cpu = cpuDeps // {
    KILN_IREE_PREFIX = "${iree-runtime}";
    cargoArtifacts = craneLib.buildDepsOnly cpuDeps;
  };

  kilnArgs = common // {
    pname = "kiln-unwrapped";
    cargoExtraArgs = "${common.cargoExtraArgs} --package kiln";
    doCheck = false;
    # The driver's library folder goes into the runpath, so the CUDA
    # driver's dlopen("libcuda.so") works on NixOS.
    nativeBuildInputs = common.nativeBuildInputs ++ [ pkgs.autoAddDriverRunpath ];
  };

  kiln-unwrapped = craneLib.buildPackage (kilnArgs // { inherit cargoArtifacts; });

  # The same binaries built again sharing nothing with the first build: their
  # own dependency build, another source folder and another bindgen seed
  # (the twin of `cargo xtask repro`, which builds from two checkouts).
  kiln-again =
    let
      again = {
        pname = "kiln-again";
        NIX_OUTPATH_USED_AS_RANDOM_SEED = "againagain";
      };
    in
    craneLib.buildPackage (
      kilnArgs
      // again
      // {
        cargoArtifacts = craneLib.buildDepsOnly (depsCommon // again);
        postUnpack = ''
          mv "$sourceRoot" kiln-second-checkout
          sourceRoot=kiln-second-checkout
        '';
      }
    );
in
{
  inherit
    common
    cargoArtifacts
    cpu
    kiln-unwrapped
    kiln-again
    ;

  # kiln's release binaries, each told where the pinned iree-compile is (a
  # user's KILN_IREE_COMPILE still wins), so `nix run` works with the IREE
  # backends as it does with the CPU one; outside NixOS the wrapper also
  # shows IREE's CUDA driver the host's libcuda (host-cuda-driver.sh says how).
  kiln =
    pkgs.runCommand "kiln-${version}"
      {
        nativeBuildInputs = [ pkgs.makeWrapper ];
        meta.mainProgram = "kiln";
      }
      ''
        mkdir -p $out/bin
        for bin in ${kiln-unwrapped}/bin/*; do
          makeWrapper "$bin" "$out/bin/$(basename "$bin")" \
            --set-default KILN_IREE_COMPILE ${lib.getExe iree-compiler} \
            --run ". ${./host-cuda-driver.sh}"
        done
      '';
}
