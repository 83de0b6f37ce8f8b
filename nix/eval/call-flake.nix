# kiln's flake outputs, called as `nix flake` calls them once it has fetched
# the lock file's inputs: crane and rust-overlay from the folders given, and
# nixpkgs as `nixpkgsDir`, which `importFile` maps to a stand-in (shared by
# the eval-nix and nix-build drivers).
{ importFile
, lib
, repo
, crane
, rustOverlay
, nixpkgsDir
,
}:
let
  callFlake =
    dir: inputs:
    let
      flake = importFile (dir + "/flake.nix");
      self = flake.outputs (inputs // { inherit self; }) // {
        outPath = dir;
      };
    in
    self;

  nixpkgs = {
    inherit lib;
    outPath = nixpkgsDir;
  };
in
callFlake repo {
  inherit nixpkgs;
  crane = callFlake crane { };
  rust-overlay = callFlake rustOverlay { inherit nixpkgs; };
}
