# The pinned iree-compile, unpacked from its wheel (the files nix/pins.json
# lists: the native binary, libIREECompiler.so and iree-lld; no Python),
# patched for the Nix store, and checked to be the pinned revision.
{ lib
, stdenv
, fetchurl
, unzip
, autoPatchelfHook
, zlib
, kilnLib
,
}:
let
  inherit (kilnLib) pins;
  wheel = kilnLib.forSystem "iree-base-compiler wheel" pins.iree.compiler.wheels stdenv.hostPlatform.system;
  inherit (pins.iree.compiler) files;
in
stdenv.mkDerivation {
  pname = "iree-compiler";
  inherit (pins.iree) version;
  src = fetchurl (kilnLib.fetchArgs wheel);

  nativeBuildInputs = [
    unzip
    autoPatchelfHook
  ];
  buildInputs = [
    (lib.getLib stdenv.cc.cc)
    zlib
  ];

  # Exactly the pinned files, the ones `cargo xtask compiler` unpacks too.
  unpackPhase = ''
    runHook preUnpack
    unzip -q "$src" ${lib.escapeShellArgs files} -d wheel
    runHook postUnpack
  '';

  # iree-compile finds libIREECompiler.so and iree-lld beside itself.
  installPhase = ''
    runHook preInstall
    mkdir -p $out/libexec/iree-compiler $out/bin
    cp ${lib.concatMapStringsSep " " (f: "wheel/${lib.escapeShellArg f}") files} $out/libexec/iree-compiler/
    ln -s $out/libexec/iree-compiler/iree-compile $out/bin/iree-compile
    runHook postInstall
  '';

  doInstallCheck = true;
  installCheckPhase = ''
    runHook preInstallCheck
    version="$($out/bin/iree-compile --version)"
    echo "$version"
    case "$version" in
      *${lib.escapeShellArg pins.iree.compiler.version_line}*) ;;
      *) echo "iree-compile is not the pinned ${pins.iree.compiler.version_line}" >&2; exit 1 ;;
    esac
    runHook postInstallCheck
  '';

  meta = {
    description = "iree-compile ${pins.iree.compiler.version_line} from the iree-base-compiler wheel";
    mainProgram = "iree-compile";
    sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
    platforms = builtins.attrNames pins.iree.compiler.wheels;
  };
}
