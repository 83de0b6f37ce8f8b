# `cargo xtask eval-nix`: the flake's outputs, evaluated with Debian's Nix
# (2.8) against real nixpkgs `lib`, real crane and real rust-overlay at the
# locked revisions, and nix/eval/nixpkgs-stand-in.nix for the packages.
# Returns, per system and output, the derivation's `.drv` path (forcing it
# instantiates the derivation); xtask reads the `.drv` files for the summary.
{ repo
, nixpkgsLib
, crane
, rustOverlay
, onlySystem ? null
,
}:
let
  standInDir = "/kiln-eval-nixpkgs-stand-in";
  importFile = import ./read-as-nix-2-8.nix {
    inherit repo;
    standIns.${standInDir} = import ./nixpkgs-stand-in.nix { inherit lib; };
  };
  lib = importFile (nixpkgsLib + "/lib");

  kiln = import ./call-flake.nix {
    inherit importFile lib repo crane rustOverlay;
    nixpkgsDir = standInDir;
  };

  systems = if onlySystem == null then builtins.attrNames kiln.packages else [ onlySystem ];
  drvPaths = lib.mapAttrs (_: drv: drv.drvPath);
in
lib.genAttrs systems (system: {
  packages = drvPaths kiln.packages.${system};
  checks = drvPaths kiln.checks.${system};
  devShells = drvPaths kiln.devShells.${system};
  formatter = kiln.formatter.${system}.drvPath;
  apps = lib.mapAttrs
    (_: app: {
      inherit (app) type;
      program = builtins.unsafeDiscardStringContext app.program;
    })
    kiln.apps.${system};
  # The overlay, applied to a package set of this system.
  overlay = builtins.attrNames (kiln.overlays.default { stdenv.hostPlatform = { inherit system; }; } { });
})
