# Everything the flake exposes for one system.
{ pkgs
, crane
, kilnLib
,
}:
let
  inherit (pkgs) lib;
  craneLib = import ./toolchain.nix { inherit pkgs crane; };
  src = import ./source.nix { inherit lib craneLib; };
  testSrc = import ./source.nix {
    inherit lib craneLib;
    forTests = true;
  };

  # The IREE derivations run xtask's prefix installer.
  xtask = import ./xtask.nix { inherit lib craneLib src; };

  ireeRuntime =
    cuda:
    pkgs.callPackage ./iree-runtime.nix {
      inherit kilnLib xtask cuda;
    };
  iree-runtime = ireeRuntime false;
  iree-runtime-cuda = ireeRuntime true;
  iree-compiler = pkgs.callPackage ./iree-compiler.nix { inherit kilnLib; };
  # Imported, not callPackage'd: callPackage would add `override` and
  # `overrideDerivation` to this set of derivations, and they would land in
  # `packages` as two non-derivations.
  models = import ./models.nix {
    inherit lib kilnLib;
    inherit (pkgs) stdenvNoCC fetchurl unzip;
  };

  reference-files = pkgs.callPackage ./reference-files.nix { inherit kilnLib; };

  packages = import ./packages.nix {
    inherit
      lib
      pkgs
      craneLib
      src
      iree-runtime
      iree-runtime-cuda
      iree-compiler
      ;
  };
in
{
  # The pinned models too, by name (`nix build .#smollm2-135m-instruct`).
  packages = {
    default = packages.kiln;
    inherit (packages) kiln;
    inherit iree-runtime iree-runtime-cuda iree-compiler;
  }
  // models;

  checks = import ./checks.nix {
    inherit
      lib
      pkgs
      craneLib
      src
      testSrc
      packages
      iree-compiler
      xtask
      models
      reference-files
      ;
  };

  formatter = pkgs.nixpkgs-fmt;

  devShell = import ./dev-shell.nix {
    inherit lib pkgs craneLib iree-runtime-cuda iree-compiler;
  };
}
