{
  description = "kiln: a Llama-family inference engine with an ahead-of-time compiled OpenXLA/IREE path";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";
    crane.url = "github:ipetkov/crane/v0.23.4";
    rust-overlay = {
      url = "github:oxalica/rust-overlay";
      inputs.nixpkgs.follows = "nixpkgs";
    };
  };

  outputs =
    { self
    , nixpkgs
    , crane
    , rust-overlay
    ,
    }:
    let
      inherit (nixpkgs) lib;
      kilnLib = import ./nix/lib.nix { inherit lib; };
      # nixpkgs cannot cross-compile CUDA: each system builds natively.
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      perSystem = lib.genAttrs systems (
        system:
        import ./nix {
          inherit crane kilnLib;
          pkgs = import ./nix/nixpkgs.nix {
            inherit
              nixpkgs
              rust-overlay
              system
              kilnLib
              ;
          };
        }
      );
      forSystems = f: lib.genAttrs systems (system: f perSystem.${system});
    in
    {
      packages = forSystems (s: s.packages);

      checks = forSystems (s: s.checks);

      devShells = forSystems (s: {
        default = s.devShell;
      });

      apps = forSystems (s: rec {
        default = kiln;
        kiln = {
          type = "app";
          program = lib.getExe s.packages.kiln;
        };
        kiln-bench-decode = {
          type = "app";
          program = "${s.packages.kiln}/bin/kiln-bench-decode";
        };
      });

      formatter = forSystems (s: s.formatter);

      overlays.default = final: _prev: {
        inherit (self.packages.${final.stdenv.hostPlatform.system})
          kiln
          iree-runtime
          iree-runtime-cuda
          iree-compiler
          ;
      };
    };
}
