# How `cargo xtask eval-nix` reads Nix files: every file is imported through
# `scopedImport`, which lets the evaluation
#   - record each repository file it reads (a `trace: kiln-eval-read: PATH`
#     line on stderr, for the hash list of nix/eval/summary.json);
#   - provide what Nix 2.8 (Debian 12's) lacks: `builtins.readFileType`;
#   - patch, in memory, the one crane line that relies on newer Nix: its
#     `mkDummySrc` joins `Cargo.toml + "/../x"`, which Nix 2.8 does not
#     normalise;
#   - hand the nixpkgs stand-in to `import nixpkgs { … }`.
# Upstream files are read where they lie and never copied into kiln.
{ repo
, standIns
,
}:
let
  repoPrefix = toString repo + "/";
  readFileType =
    builtins.readFileType or (
      path:
      let
        listing = builtins.readDir (dirOf path);
      in
      listing.${baseNameOf path}
    );

  recordRead =
    path: value:
    let
      p = toString path;
      inRepo = builtins.substring 0 (builtins.stringLength repoPrefix) p == repoPrefix;
    in
    if inRepo then
      builtins.trace "kiln-eval-read: ${builtins.substring (builtins.stringLength repoPrefix) (-1) p}" value
    else
      value;

  readFile = path: recordRead path (builtins.readFile path);

  patches = {
    "lib/mkDummySrc.nix" = {
      from = ''shallowJoinPath = rest: p + "/../''${rest}";'';
      to = ''shallowJoinPath = rest: (dirOf p) + "/''${rest}";'';
    };
  };
  patchedFile =
    file:
    let
      matching = builtins.filter
        (suffix: builtins.match ".*/${suffix}" (toString file) != null)
        (builtins.attrNames patches);
      patch = patches.${builtins.head matching};
      text = builtins.readFile file;
    in
    if matching == [ ] then
      file
    else if builtins.replaceStrings [ patch.from ] [ "" ] text == text then
      throw "eval-nix: ${toString file} no longer contains the line its Nix 2.8 patch replaces; update nix/eval/read-as-nix-2-8.nix"
    else
      builtins.toFile (baseNameOf file) (builtins.replaceStrings [ patch.from ] [ patch.to ] text);

  importFile =
    target:
    let
      path = target.outPath or target;
      file = if readFileType path == "directory" then path + "/default.nix" else path;
    in
      standIns.${toString path} or (recordRead file (builtins.scopedImport scope (patchedFile file)));

  scope = {
    import = importFile;
    builtins = builtins // {
      import = importFile;
      inherit readFile readFileType;
    };
  };
in
importFile
