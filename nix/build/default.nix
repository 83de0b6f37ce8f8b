# `cargo xtask nix-build`: the flake's packages and checks for this machine's
# system, built by real Nix (Debian's 2.8) from the flake's own Nix files,
# with real nixpkgs `lib`, real crane and real rust-overlay at the locked
# revisions, and nix/build/host-nixpkgs.nix for nixpkgs' packages. The files
# are read as `cargo xtask eval-nix` reads them (nix/eval/read-as-nix-2-8.nix).
{ repo
, nixpkgsLib
, crane
, rustOverlay
, system
  # The host's tools (host-nixpkgs.nix says which), given by xtask.
, hostPath
, hostBash
, hostCertificates
, rustToolchain
, rustVersion
, cargoNextest
, nixpkgsFmt
, deadnix
, libclang
,
}:
let
  standInDir = "/kiln-host-nixpkgs";
  importFile = import ../eval/read-as-nix-2-8.nix {
    inherit repo;
    standIns.${standInDir} = import ./host-nixpkgs.nix {
      inherit lib;
      host = {
        path = hostPath;
        bash = hostBash;
        certificates = hostCertificates;
        inherit
          rustToolchain
          rustVersion
          cargoNextest
          nixpkgsFmt
          deadnix
          libclang
          ;
      };
    };
  };
  lib = importFile (nixpkgsLib + "/lib");

  kiln = import ../eval/call-flake.nix {
    inherit importFile lib repo crane rustOverlay;
    nixpkgsDir = standInDir;
  };
in
{
  packages = kiln.packages.${system};
  checks = kiln.checks.${system};
  devShells = kiln.devShells.${system};
}
