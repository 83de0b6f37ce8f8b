# The files others released that tests/released_files.rs holds kiln to
# (nix/pins.json `reference_files`): each archive a fixed-output download,
# only its listed members unpacked, flat by file name, each checked against
# its own sha256 — the folder `cargo xtask reference-files` makes, for
# KILN_REFERENCE_FILES in the checks that run the tests.
{ lib
, stdenvNoCC
, fetchurl
, kilnLib
,
}:
let
  archives = lib.filterAttrs (id: _: !lib.hasPrefix "_" id) kilnLib.pins.reference_files;
  unpack =
    _id: pin:
    let
      members = lib.attrNames pin.members;
    in
    ''
      tar -xzf ${fetchurl (kilnLib.fetchArgs pin)} -C "$TMPDIR/members" ${lib.escapeShellArgs members}
    ''
    + lib.concatStrings (
      lib.mapAttrsToList
        (member: sha256: ''
          echo "${sha256}  $TMPDIR/members/"${lib.escapeShellArg member} | sha256sum --check --quiet
          mv "$TMPDIR/members/"${lib.escapeShellArg member} "$out/"${lib.escapeShellArg (baseNameOf member)}
        '')
        pin.members
    );
in
stdenvNoCC.mkDerivation {
  name = "kiln-reference-files";
  dontUnpack = true;
  installPhase = ''
    runHook preInstall
    mkdir -p "$out" "$TMPDIR/members"
    ${lib.concatStrings (lib.mapAttrsToList unpack archives)}
    runHook postInstall
  '';
}
