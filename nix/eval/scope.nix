# What both of kiln's nixpkgs stand-ins (nix/eval/nixpkgs-stand-in.nix for
# evaluation, nix/build/host-nixpkgs.nix for builds) give crane and
# rust-overlay to build their scopes with: nixpkgs' callPackage and splicing,
# with no cross-compilation, so every package set is this one (`final`).
{ lib, final }:
{
  callPackage = lib.callPackageWith final;
  newScope = extra: lib.callPackageWith (final // extra);
  makeScopeWithSplicing' = lib.makeScopeWithSplicing' {
    inherit (final) newScope;
    splicePackages = { pkgsHostTarget, ... }: pkgsHostTarget;
  };
  splicePackages = { pkgsHostTarget, ... }: pkgsHostTarget;
  pkgsBuildBuild = final;
  pkgsBuildHost = final;
  pkgsBuildTarget = final;
  pkgsHostHost = final;
  pkgsHostTarget = final;
  pkgsTargetTarget = final;
  buildPackages = final;
}
