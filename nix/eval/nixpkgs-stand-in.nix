# A stand-in for the parts of nixpkgs the flake uses, for `cargo xtask
# eval-nix` (nixpkgs itself is out of reach of kiln's CI; its `lib/` is real).
#
# Every package is a derivation that cannot be built (its builder exits 1):
# the evaluation instantiates `.drv` files and builds nothing. What the real
# nixpkgs would refuse, this refuses too, and a little more:
#   - `callPackage` is nixpkgs' own (`lib.callPackageWith`): a file asking for
#     an argument the set lacks fails, as a misspelt package name would.
#   - `stdenv.mkDerivation` checks `meta` as nixpkgs' check-meta does with
#     the flake's config (unfree licences against `allowUnfreePredicate`,
#     `broken`, `platforms`), `env` values as nixpkgs does (strings, bools,
#     integers, derivations), and, stricter than nixpkgs, the argument
#     names and types: an unknown lower-case argument (a misspelt crane or
#     stdenv argument, which nixpkgs would silently turn into an environment
#     variable) and a list where a string is expected both fail.
#   - `cudaPackages_X_Y` refuses capabilities its CUDA release cannot target,
#     and carries the package versions of nixpkgs' CUDA manifests.
#   - Only the attributes below exist: anything else is a missing attribute.
{ lib }:
{ system
, config ? { }
, overlays ? [ ]
,
}:
let
  platform = lib.systems.elaborate system;

  # A package nobody builds: what the evaluation needs is its name, outputs,
  # `meta` and `passthru`.
  leaf =
    { pname
    , version ? "stand-in"
    , outputs ? [ "out" ]
    , meta ? { }
    , passthru ? { }
    , env ? { }
    ,
    }:
    mkDerivation {
      inherit pname version outputs meta passthru;
      builder = "/bin/sh";
      args = [
        "-c"
        "echo 'kiln eval-nix stand-in: not buildable' >&2; exit 1"
      ];
      inherit env;
    };

  # The shell every stdenv derivation runs; a leaf itself.
  shell = mkDerivation {
    pname = "bash";
    version = "stand-in";
    builder = "/bin/sh";
    args = [
      "-c"
      "exit 1"
    ];
  };

  # The other arguments of stdenv.mkDerivation (and of the hooks crane and the
  # flake use) whose names do not follow one of the patterns in
  # `argumentPatterns`; the list arguments are in `listArguments`.
  knownArguments = [
    # stdenv
    "name"
    "pname"
    "version"
    "src"
    "sourceRoot"
    "builder"
    "meta"
    "passthru"
    "env"
    "strictDeps"
    "unpackPhase"
    "patchPhase"
    "configurePhase"
    "buildPhase"
    "checkPhase"
    "installPhase"
    "fixupPhase"
    "installCheckPhase"
    "distPhase"
    "buildCommand"
    "setupHook"
    "shellHook"
    "enableParallelBuilding"
    "separateDebugInfo"
    "preferLocalBuild"
    "allowSubstitutes"
    "outputHash"
    "outputHashAlgo"
    "outputHashMode"
    "url"
    "system"
    "stdenv"
    # makeSetupHook
    "substitutions"
    # crane's builders and setup hooks
    "cargoArtifacts"
    "cargoBuildCommand"
    "cargoCheckCommand"
    "cargoClippyExtraArgs"
    "cargoExtraArgs"
    "cargoLock"
    "cargoNextestExtraArgs"
    "cargoNextestPartitionsExtraArgs"
    "cargoTestCommand"
    "cargoTestExtraArgs"
    "cargoVendorDir"
    "checkPhaseCargoCommand"
    "buildPhaseCargoCommand"
    "installPhaseCommand"
    "installCargoArtifactsMode"
    "pnameSuffix"
    "rustFmtExtraArgs"
    "withLlvmCov"
    "ensureTargetDir"
    # rust-overlay's toolchain derivations
  ];
  argumentPatterns = [
    "(pre|post)[A-Z].*" # phase hooks
    "dont[A-Z].*" # phase switches
    "do[A-Z].*" # doCheck, doInstallCargoArtifacts, …
    "[A-Z_][A-Z0-9_]*" # environment variables
    "__[a-zA-Z]+" # __structuredAttrs, __impure, …
  ];
  knownArgument =
    name: lib.elem name knownArguments || lib.elem name listArguments || lib.any (p: builtins.match p name != null) argumentPatterns;

  # Arguments that are lists; every other argument must be a scalar.
  listArguments = [
    "srcs"
    "args"
    "outputs"
    "nativeBuildInputs"
    "buildInputs"
    "propagatedBuildInputs"
    "propagatedNativeBuildInputs"
    "depsBuildBuild"
    "depsHostHost"
    "depsHostHostPropagated"
    "depsTargetTargetPropagated"
    "nativeCheckInputs"
    "checkInputs"
    "nativeInstallCheckInputs"
    "phases"
    "patches"
    "cmakeFlags"
    "configureFlags"
    "makeFlags"
    "hardeningDisable"
    "passAsFile"
    "urls"
    "availableComponents"
    "selectedComponents"
    "paths"
  ];
  # What becomes a string: strings, booleans, integers, paths, null, and
  # derivations and sources (attribute sets with an `outPath`).
  isScalar = v: builtins.isString v || builtins.isBool v || builtins.isInt v || builtins.isPath v || v == null || v ? outPath;

  checkArguments =
    strictNames: name: attrs:
    let
      unknown = lib.optionals strictNames (lib.filter (n: !knownArgument n) (builtins.attrNames attrs));
      badType = lib.filter
        (
          n:
          let
            v = attrs.${n};
          in
          if !strictNames && !knownArgument n then
            false
          else if lib.elem n listArguments || lib.hasSuffix "Phases" n then
            !builtins.isList v
          else
            !(isScalar v || lib.elem n [ "meta" "passthru" "env" "substitutions" "stdenv" "cargoLock" ])
        )
        (builtins.attrNames attrs);
      badEnv = lib.filter (n: !(isScalar attrs.env.${n}) || builtins.isPath attrs.env.${n}) (
        builtins.attrNames (attrs.env or { })
      );
    in
    if unknown != [ ] then
      throw "mkDerivation ${name}: unknown argument(s) ${lib.concatStringsSep ", " unknown} (misspelt? nixpkgs would pass them on silently as environment variables)"
    else if badType != [ ] then
      throw "mkDerivation ${name}: argument(s) ${lib.concatStringsSep ", " badType} of the wrong type (${
        lib.concatMapStringsSep ", " (n: "${n} is a ${builtins.typeOf attrs.${n}}") badType
      }; lists are for ${lib.concatStringsSep "/" (lib.take 3 listArguments)}…, strings for the rest)"
    else if badEnv != [ ] then
      throw "mkDerivation ${name}: the `env` attribute set can only contain derivation, string, boolean or integer attributes; ${lib.concatStringsSep ", " badEnv} is not"
    else
      true;

  # nixpkgs' check-meta, with the flake's config.
  checkMeta =
    name: meta:
    let
      licenses = lib.toList (meta.license or [ ]);
      unfree = lib.any (l: !(l.free or true)) licenses;
      allowUnfree = config.allowUnfree or false || (config.allowUnfreePredicate or (_: false)) { inherit meta name; };
    in
    if unfree && !allowUnfree then
      throw "Package ‘${name}’ has an unfree license (‘${
        lib.concatMapStringsSep ", " (l: l.shortName or "?") licenses
      }’), refusing to evaluate (the flake's allowUnfreePredicate refuses it)."
    else if meta.broken or false && !(config.allowBroken or false) then
      throw "Package ‘${name}’ is marked as broken, refusing to evaluate."
    else if !(lib.meta.availableOn platform { inherit meta; }) then
      throw "Package ‘${name}’ is not available on the requested hostPlatform ${system} (meta.platforms: ${
        lib.concatStringsSep ", " (map toString meta.platforms)
      }), refusing to evaluate."
    else
      true;

  # stdenv.mkDerivation: attributes or `finalAttrs: attributes`, with
  # `overrideAttrs`. `strictNames = false` for runCommand's free-form
  # environment.
  mkDerivationWith =
    strictNames: fnOrAttrs:
    let
      attrsFn = if lib.isFunction fnOrAttrs then fnOrAttrs else (_: fnOrAttrs);
      attrs = attrsFn attrs;
      name =
        attrs.name or (
          if builtins.isString (attrs.pname or null) && builtins.isString (attrs.version or null) then
            "${attrs.pname}-${attrs.version}"
          else
            throw "mkDerivation: pname and version must be strings, or name given (got pname: ${
              builtins.typeOf (attrs.pname or null)
            }, version: ${builtins.typeOf (attrs.version or null)})"
        );
      meta = attrs.meta or { };
      passthru = attrs.passthru or { };
      derivationArgs =
        builtins.removeAttrs attrs [
          "meta"
          "passthru"
          "env"
          "pname"
          "stdenv"
          "substitutions"
        ]
        // (attrs.env or { })
        // {
          inherit name system;
          builder = attrs.builder or "${shell}/bin/bash";
          args = attrs.args or [
            "-e"
            "stand-in-default-builder.sh"
          ];
        };
      drv =
        assert checkArguments strictNames name attrs;
        assert checkMeta name meta;
        derivation derivationArgs;
    in
    drv
    // passthru
    // {
      inherit meta passthru;
      overrideAttrs =
        f:
        mkDerivationWith strictNames (
          final:
          let
            prev = attrsFn final;
          in
          prev // lib.toExtension f final prev
        );
    }
    // lib.optionalAttrs (attrs ? pname) { inherit (attrs) pname; }
    // lib.optionalAttrs (attrs ? version) { inherit (attrs) version; };

  mkDerivation = mkDerivationWith true;

  stdenv = {
    inherit mkDerivation shell;
    inherit (platform) isLinux isDarwin;
    hostPlatform = platform;
    buildPlatform = platform;
    targetPlatform = platform;
    cc = leaf { pname = "gcc-wrapper"; } // {
      cc = leaf {
        pname = "gcc";
        outputs = [
          "out"
          "lib"
        ];
      };
      bintools = leaf { pname = "binutils-wrapper"; } // {
        expandResponseParams = "expand-response-params";
        shell = "${shell}/bin/bash";
        suffixSalt = lib.replaceStrings [ "-" "." ] [ "_" "_" ] platform.config;
        wrapperName = "BINTOOLS_WRAPPER";
        coreutils_bin = "coreutils";
      };
      isGNU = true;
      isClang = false;
    };
  };

  licences = {
    # nixpkgs' lib.licenses.nvidiaCudaRedist (its `lib` is real; the
    # CUDA packages themselves are stood in for).
    cuda = lib.licenses.nvidiaCudaRedist;
  };

  # The CUDA releases the stand-in knows: package versions (nixpkgs'
  # pkgs/development/cuda-modules/_cuda/manifests/cuda/redistrib_12.8.2.json
  # and redistrib_12.9.2.json) and the newest capability each can target.
  cudaReleases = {
    "12_8" = {
      majorMinor = "12.8";
      newestCapability = "12.0";
      versions = {
        cuda_cudart = "12.8.90";
        cuda_nvcc = "12.8.93";
        cuda_cccl = "12.8.90";
      };
    };
    "12_9" = {
      majorMinor = "12.9";
      newestCapability = "12.1";
      versions = {
        cuda_cudart = "12.9.79";
        cuda_nvcc = "12.9.86";
        cuda_cccl = "12.9.27";
      };
    };
  };
  cudaOutputs = {
    cuda_cudart = [
      "out"
      "dev"
      "include"
      "lib"
      "static"
      "stubs"
    ];
    cuda_nvcc = [
      "out"
      "bin"
      "dev"
      "include"
      "static"
    ];
    cuda_cccl = [
      "out"
      "dev"
      "include"
    ];
  };
  mkCudaPackages =
    release:
    let
      unsupported = lib.filter (c: lib.versionOlder release.newestCapability c) (config.cudaCapabilities or [ ]);
    in
    if unsupported != [ ] then
      throw "CUDA ${release.majorMinor} does not support the requested capabilities ${lib.concatStringsSep ", " unsupported}"
    else
      lib.mapAttrs
        (
          pname: version:
          leaf {
            inherit pname version;
            outputs = cudaOutputs.${pname};
            meta = {
              license = licences.cuda;
              platforms = [
                "x86_64-linux"
                "aarch64-linux"
              ];
            };
          }
        )
        release.versions
      // {
        cudaMajorMinorVersion = release.majorMinor;
        cudaMajorVersion = lib.versions.major release.majorMinor;
        backendStdenv = stdenv;
      };

  # A setup hook (a script sourced by the builds that use it).
  makeSetupHook =
    { name
    , propagatedBuildInputs ? [ ]
    , depsTargetTargetPropagated ? [ ]
    , substitutions ? { }
    , meta ? { }
    , passthru ? { }
    ,
    }:
    script:
    mkDerivation {
      inherit name propagatedBuildInputs depsTargetTargetPropagated substitutions meta passthru;
      setupHook = script;
    };

  runCommandWith =
    name: env: buildCommand:
    mkDerivationWith false (
      {
        inherit name buildCommand;
      }
      // env
    );

  basePackages =
    final:
    let
      simple = names: lib.genAttrs names (pname: leaf { inherit pname; });
    in
    simple [
      "cmake"
      "ninja"
      "unzip"
      "zlib"
      "pkg-config"
      "autoPatchelfHook"
      "autoAddDriverRunpath"
      "cargo-nextest"
      "cargo-llvm-cov"
      "nixpkgs-fmt"
      "deadnix"
      "jq"
      "zstd"
      "rsync"
      "git"
      "bash"
      "curl"
      "gnutar"
      "bintools"
      "lndir"
      "makeWrapper"
      "remarshal"
      "taplo"
      "writableTmpDirAsHomeHook"
      # nixpkgs' own Rust (crane's default before overrideToolchain)
      "rustc"
      "cargo"
      "clippy"
      "rustfmt"
    ]
    // {
      inherit lib stdenv config system;
      pkgs = final;
      stdenvNoCC = stdenv;
      # nixpkgs' root, as rust-overlay names files under it (never read).
      path = "/stand-in-nixpkgs";
      gccForLibs = leaf {
        pname = "gcc";
        outputs = [
          "out"
          "lib"
          "libgcc"
        ];
      };
      # Only the Python packages the flake asks for exist: a misspelt one
      # is a missing attribute, as in nixpkgs.
      python3 = leaf { pname = "python3"; } // {
        withPackages =
          pick:
          leaf {
            pname = lib.concatMapStringsSep "-" (p: p.pname) (
              [{ pname = "python3-with"; }] ++ pick { jinja2.pname = "jinja2"; }
            );
          };
      };
      llvmPackages.libclang = leaf {
        pname = "clang";
        outputs = [
          "out"
          "lib"
          "dev"
        ];
      };
      rustPlatform = {
        bindgenHook = leaf { pname = "rust-bindgen-hook"; };
        # Builds crane's own helper; its lock file must exist.
        buildRustPackage =
          { cargoLock, ... }@args:
            assert lib.assertMsg (builtins.pathExists cargoLock.lockFile) "buildRustPackage: no ${toString cargoLock.lockFile}";
            mkDerivation (builtins.removeAttrs args [ "cargoLock" ]);
      };

      fetchurl =
        { url
        , sha256 ? null
        , hash ? null
        , name ? baseNameOf url
        , ...
        }@args:
          assert lib.assertMsg (sha256 != null || hash != null) "fetchurl ${url}: no hash given";
          assert lib.assertMsg (builtins.isString url) "fetchurl: url must be a string";
          derivation
            {
              inherit name system url;
              builder = "/bin/sh";
              args = [
                "-c"
                "exit 1"
              ];
              outputHashMode = "flat";
              outputHashAlgo = if hash != null then null else "sha256";
              outputHash = if hash != null then hash else sha256;
            }
          // {
            meta = args.meta or { };
          };


      inherit makeSetupHook;
      runCommand = runCommandWith;
      runCommandLocal = runCommandWith;
      writeText =
        name: text:
        runCommandWith name
          {
            inherit text;
            passAsFile = [ "text" ];
          } "cp $textPath $out";
      symlinkJoin =
        { name, ... }@args:
          assert lib.assertMsg (builtins.isList (args.paths or null)) "symlinkJoin ${name}: paths must be a list";
          runCommandWith name (builtins.removeAttrs args [ "name" ]) "stand-in";
      mkShell =
        { packages ? [ ]
        , inputsFrom ? [ ]
        , shellHook ? ""
        , ...
        }@args:
        mkDerivation (
          builtins.removeAttrs args [
            "packages"
            "inputsFrom"
          ]
          // {
            name = args.name or "nix-shell";
            nativeBuildInputs = packages ++ lib.concatMap (d: d.nativeBuildInputs or [ ]) inputsFrom;
            inherit shellHook;
          }
        );
    }
    // import ./scope.nix { inherit lib final; }
    // lib.mapAttrs' (attr: release: lib.nameValuePair "cudaPackages_${attr}" (mkCudaPackages release)) cudaReleases;
in
lib.fix (lib.foldl' (base: overlay: lib.extends overlay base) basePackages overlays)
