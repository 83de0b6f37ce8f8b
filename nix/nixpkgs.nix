# nixpkgs for one system, configured for CUDA on the pinned capabilities with
# the pinned CUDA release, and with rust-overlay for the toolchain.
{ nixpkgs
, rust-overlay
, system
, kilnLib
,
}:
import nixpkgs {
  inherit system;
  config = {
    cudaSupport = true;
    cudaCapabilities = kilnLib.cudaCapabilities;
    allowUnfreePredicate = kilnLib.allowCudaLicences;
  };
  overlays = [
    rust-overlay.overlays.default
    (final: _prev: { cudaPackages = final.${kilnLib.cudaPackagesAttr}; })
  ];
}
