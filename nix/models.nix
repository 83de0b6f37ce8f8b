# The pinned models (nix/pins.json `models`): each the GGUF member of its
# pinned archive, as a fixed-output file — the same bytes `kiln pull` puts in
# the cache. `kiln --model "$(nix build .#NAME --print-out-paths)"` runs it.
{ lib
, stdenvNoCC
, fetchurl
, unzip
, kilnLib
,
}:
let
  model =
    id: pin:
    stdenvNoCC.mkDerivation {
      name = "${id}.gguf";
      src = fetchurl (kilnLib.fetchArgs pin);
      nativeBuildInputs = [ unzip ];
      dontUnpack = true;
      installPhase = ''
        runHook preInstall
        unzip -p "$src" ${lib.escapeShellArg pin.member} > "$out"
        runHook postInstall
      '';
      outputHashMode = "flat";
      outputHashAlgo = "sha256";
      outputHash = pin.member_sha256;
      meta.description = pin.description;
    };
in
lib.mapAttrs model (lib.filterAttrs (id: _: !lib.hasPrefix "_" id) kilnLib.pins.models)
