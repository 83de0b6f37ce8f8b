# A package set that stands in for nixpkgs in real builds on a machine that
# cannot reach nixpkgs' sources or its binary cache (kiln's CI machines and
# sessions reach only the package registries). `cargo xtask nix-build`
# builds the flake's own Nix files, unmodified, against it.
#
# What is nixpkgs' own on a real Nix machine, and what it is here:
#   - stdenv: nix/build/setup.sh (kiln's, with nixpkgs' phases and hook
#     names) with the host's tools on PATH (`host.path`): the host's gcc,
#     binutils, coreutils, tar, patch, make. No compiler wrapper, no
#     hardening flags, no stripping.
#   - Rust: the host's rustup toolchain, copied into the store
#     (`host.rustToolchain`, checked against rust-toolchain.toml's channel).
#   - cmake, ninja, CUDA 12.9 (cudart, nvcc, cccl): the pinned wheels of
#     nix/pins.json, fetched by URL and hash, laid out as nixpkgs lays them
#     out. fetchurl is a real fixed-output download.
#   - jq, zstd, rsync, unzip, git, pkg-config, patchelf, libclang: the
#     host's (Debian's packages), linked from the host's folders.
#   - cargo-nextest, nixpkgs-fmt, deadnix: the host's binaries, copied into
#     the store (`cargo xtask setup` builds the pinned nixpkgs-fmt and
#     deadnix).
#   - callPackage, runCommand, writeText, makeSetupHook, symlinkJoin,
#     makeWrapper, mkShell, rustPlatform.buildRustPackage (crane builds its
#     own helper with it): written here, as small as the flake and crane
#     need.
# Everything else is a missing attribute.
{ lib
, host
,
}:
{ system
, config ? { }
, overlays ? [ ]
,
}:
let
  platform = lib.systems.elaborate system;
  pins = lib.importJSON ../pins.json;
  setupScript = ./setup.sh;

  # stdenv.mkDerivation: attributes or `finalAttrs: attributes`, with
  # `overrideAttrs`; `env` merged into the environment as nixpkgs does.
  mkDerivation =
    fnOrAttrs:
    let
      attrsFn = if lib.isFunction fnOrAttrs then fnOrAttrs else (_: fnOrAttrs);
      attrs = attrsFn attrs;
      name = attrs.name or "${attrs.pname}-${attrs.version}";
      passthru = attrs.passthru or { };
      drv = derivation (
        builtins.removeAttrs attrs [
          "meta"
          "passthru"
          "env"
          "pname"
          "stdenv"
        ]
        // (attrs.env or { })
        // {
          inherit name system;
          builder = host.bash;
          args = [
            "-e"
            setupScript
          ];
          initialPath = host.path;
        }
      );
    in
    drv
    // passthru
    // {
      inherit passthru;
      meta = attrs.meta or { };
      overrideAttrs =
        f:
        mkDerivation (
          final:
          let
            prev = attrsFn final;
          in
          prev // lib.toExtension f final prev
        );
    }
    // lib.optionalAttrs (attrs ? pname) { inherit (attrs) pname; }
    // lib.optionalAttrs (attrs ? version) { inherit (attrs) version; };

  stdenv = {
    inherit mkDerivation;
    inherit (platform) isLinux isDarwin;
    hostPlatform = platform;
    buildPlatform = platform;
    targetPlatform = platform;
    # The host's gcc: crane reads its target prefix (empty: no cross
    # compilation here); iree-compiler asks for its library output.
    cc = hostTool "gcc" [ "cc" "c++" "gcc" "g++" "ar" "ld" ] // {
      cc = hostTool "gcc-lib" [ ];
      targetPrefix = "";
      isGNU = true;
      isClang = false;
    };
  };

  runCommand =
    name: env: buildCommand:
    mkDerivation ({ inherit name buildCommand; } // env);

  writeText =
    name: text:
    runCommand name
      {
        inherit text;
        passAsFile = [ "text" ];
      } ''cp "$textPath" "$out"'';

  # A package that is the host's programs: $out/bin holds links to them. The
  # build fails, naming the program, when the host lacks one.
  hostTool =
    pname: programs:
    runCommand "host-${pname}" { inherit programs; } ''
      mkdir -p $out/bin
      for program in $programs; do
        found="$(command -v "$program")" || {
          echo "the host has no $program (kiln's Nix build takes it from the host: install it, e.g. apt-get install $program)" >&2
          exit 1
        }
        ln -s "$found" "$out/bin/$program"
      done
    '';

  # A host binary copied into the store (its content fixes its path).
  storedBinary =
    name: file:
    let
      copy = builtins.path {
        path = /. + file;
        name = "host-${name}";
      };
    in
    runCommand name { } ''
      mkdir -p $out/bin
      cp ${copy} $out/bin/${name}
      chmod +x $out/bin/${name}
    '';

  # A setup hook: the script, its @name@ placeholders substituted, becomes
  # $out/nix-support/setup-hook.
  makeSetupHook =
    { name
    , propagatedBuildInputs ? [ ]
    , substitutions ? { }
    , ...
    }:
    script:
    let
      names = builtins.attrNames substitutions;
      text = builtins.replaceStrings (map (n: "@${n}@") names) (map (n: toString substitutions.${n}) names) (
        builtins.readFile script
      );
    in
    mkDerivation {
      inherit name propagatedBuildInputs;
      dontUnpack = true;
      setupHook = writeText "${name}.sh" text;
      installPhase = "mkdir -p $out";
    };

  # A wheel (a zip) unpacked; `install` lays out $out from ./wheel.
  fromWheel =
    { pname
    , version
    , pin
    , install
    , outputs ? [ "out" ]
    , meta ? { }
    ,
    }:
    mkDerivation {
      inherit pname version outputs meta;
      src = fetchurl {
        inherit (pin) url sha256 name;
      };
      unpackPhase = ''unzip -q "$src" -d wheel'';
      installPhase = install;
    };

  fetchurl =
    { url
    , sha256 ? null
    , hash ? null
    , name ? baseNameOf url
    , ...
    }:
    derivation {
      inherit name system url;
      builder = host.bash;
      args = [
        "-ec"
        ''curl --fail --location --silent --show-error --retry 3 --output "$out" "$url"''
      ];
      PATH = host.path;
      # Debian's certificates: the sandbox gives fixed-output downloads the
      # network but not the host's /etc.
      SSL_CERT_FILE = host.certificates;
      outputHashMode = "flat";
      outputHashAlgo = if hash != null then null else "sha256";
      outputHash = if hash != null then hash else sha256;
    };

  # CUDA's pieces from the pinned wheels: everything of the wheel's folder in
  # `out`, its headers in `include`, its programs and nvvm/ in `bin`, as
  # lib.getInclude and lib.getBin find them in nixpkgs.
  cudaPackage =
    wheel:
    let
      pin = wheel.${system} or (throw "nix/pins.json pins no ${wheel.nixpkgs} wheel for ${system}");
      folder = builtins.head (lib.splitString "/include" (builtins.head (builtins.head wheel.layout)));
    in
    fromWheel {
      pname = wheel.nixpkgs;
      inherit (wheel) version;
      inherit pin;
      outputs = [
        "out"
        "bin"
        "include"
        "dev"
        "lib"
      ];
      install = ''
        cp -r wheel/${folder} $out
        mkdir -p $bin $include $dev $lib
        [ -d $out/include ] && cp -r $out/include $include/include
        [ -d $out/bin ] && cp -r $out/bin $bin/bin
        [ -d $out/nvvm ] && cp -r $out/nvvm $bin/nvvm
        [ -d $out/lib ] && cp -r $out/lib $lib/lib
        true
      '';
      meta = {
        license = lib.licenses.nvidiaCudaRedist;
        platforms = [
          "x86_64-linux"
          "aarch64-linux"
        ];
      };
    };
  cudaPackages =
    let
      wheels = lib.filterAttrs (name: _: !lib.hasPrefix "_" name) pins.cuda.wheels;
    in
    lib.mapAttrs' (_: wheel: lib.nameValuePair wheel.nixpkgs (cudaPackage wheel)) wheels
    // {
      cudaMajorMinorVersion = pins.cuda.version;
      cudaMajorVersion = lib.versions.major pins.cuda.version;
      backendStdenv = stdenv;
    };

  tool =
    name:
    let
      pin = pins.tools.${name};
    in
    fromWheel {
      pname = name;
      inherit (pin) version;
      pin = pin.${system};
      install =
        if name == "cmake" then
          "cp -r wheel/cmake/data $out"
        else
          "mkdir -p $out/bin && cp wheel/${pin.binary} $out/bin/ && chmod +x $out/bin/*";
    };

  # The host's Rust toolchain in the store: `rustc --print sysroot` lies in
  # /nix/store, as crane's removeReferencesToRustToolchainHook requires.
  rustToolchain =
    let
      copy = builtins.path {
        path = /. + host.rustToolchain;
        name = "rust-${host.rustVersion}-host-toolchain";
        filter = path: _: !(lib.hasInfix "/share/doc" path);
      };
    in
    runCommand "rust-${host.rustVersion}" { } "ln -s ${copy} $out"
    // {
      version = host.rustVersion;
    };
  fromRustupToolchainFile =
    file:
    let
      wanted = (builtins.fromTOML (builtins.readFile file)).toolchain.channel;
    in
    assert lib.assertMsg (wanted == host.rustVersion)
      "${toString file} asks for Rust ${wanted}; the host toolchain given to the Nix build is ${host.rustVersion}";
    rustToolchain;

  # rustPlatform.buildRustPackage for crane's helper: the crates of its
  # Cargo.lock fetched from crates.io by checksum, built offline.
  buildRustPackage =
    { pname
    , version
    , src
    , cargoLock
    , nativeBuildInputs ? [ ]
    , ...
    }:
    let
      lock = builtins.fromTOML (builtins.readFile cargoLock.lockFile);
      registryCrates = lib.filter (p: p ? checksum) lock.package;
      crate =
        p:
        fetchurl {
          name = "${p.name}-${p.version}.crate";
          url = "https://static.crates.io/crates/${p.name}/${p.name}-${p.version}.crate";
          sha256 = p.checksum;
        };
      vendor = runCommand "${pname}-vendor" { } (
        ''
          mkdir -p $out
        ''
        + lib.concatMapStrings
          (p: ''
            tar -xzf ${crate p} -C $out
            echo '{"files":{},"package":"${p.checksum}"}' > $out/${p.name}-${p.version}/.cargo-checksum.json
          '')
          registryCrates
      );
    in
    mkDerivation {
      inherit pname version src;
      nativeBuildInputs = nativeBuildInputs ++ [ rustToolchain ];
      buildPhase = ''
        export CARGO_HOME="$PWD/.cargo-home"
        mkdir -p "$CARGO_HOME"
        printf '[source.crates-io]\nreplace-with = "vendored"\n[source.vendored]\ndirectory = "%s"\n' ${vendor} > "$CARGO_HOME/config.toml"
        cp ${cargoLock.lockFile} Cargo.lock
        cargo build --release --offline --locked
      '';
      installPhase = ''
        mkdir -p $out/bin
        find target/release -maxdepth 1 -type f -executable -exec cp {} $out/bin/ \;
      '';
    };

  basePackages =
    final:
    {
      inherit lib stdenv config system fetchurl runCommand writeText makeSetupHook;
      pkgs = final;
      stdenvNoCC = stdenv;
      runCommandLocal = runCommand;
      # nixpkgs' root, as rust-overlay names files under it (never read here).
      path = "/kiln-host-nixpkgs";

      cmake = tool "cmake";
      ninja = tool "ninja";
      jq = hostTool "jq" [ "jq" ];
      zstd = hostTool "zstd" [ "zstd" ];
      rsync = hostTool "rsync" [ "rsync" ];
      unzip = hostTool "unzip" [ "unzip" ];
      git = hostTool "git" [ "git" ];
      gnutar = hostTool "tar" [ "tar" ];
      pkg-config = hostTool "pkg-config" [ "pkg-config" ];
      zlib = hostTool "zlib" [ ];
      # The host's python3, which must import every module asked for (the
      # build fails, naming it, where it does not): Debian's python3-jinja2
      # for the tests' Jinja2.
      python3.withPackages =
        pick:
        let
          modules = map (p: p.module) (pick {
            jinja2.module = "jinja2";
          });
        in
        runCommand "host-python3-env" { inherit modules; } ''
          python="$(command -v python3)" || {
            echo "the host has no python3 (apt-get install python3)" >&2
            exit 1
          }
          for module in $modules; do
            "$python" -c "import $module" || {
              echo "the host's python3 cannot import $module (Debian: apt-get install python3-$module)" >&2
              exit 1
            }
          done
          mkdir -p $out/bin
          ln -s "$python" $out/bin/python3
        '';
      # nixpkgs' mkShell, as `nix-shell` enters it (`cargo xtask nix-build
      # --shell`): nix-shell sources $stdenv/setup, here setup.sh told to set
      # up PATH and the inputs' hooks without building; then shellHook.
      # Built, the shell is a file naming its inputs.
      mkShell =
        { packages ? [ ]
        , inputsFrom ? [ ]
        , ...
        }@args:
        mkDerivation (
          builtins.removeAttrs args [
            "packages"
            "inputsFrom"
          ]
          // {
            name = args.name or "kiln-shell";
            nativeBuildInputs = packages ++ lib.concatMap (d: d.nativeBuildInputs or [ ]) inputsFrom;
            # In `env`: mkDerivation drops a `stdenv` attribute (crane
            # passes its stdenv as one).
            env = (args.env or { }) // {
              stdenv = runCommand "kiln-shell-setup" { } ''
                mkdir $out
                { echo kilnSetupOnly=1; cat ${setupScript}; } > $out/setup
              '';
            };
            buildCommand = ''echo "$nativeBuildInputs" > "$out"'';
          }
        );
      cargo-nextest = storedBinary "cargo-nextest" host.cargoNextest;
      nixpkgs-fmt = storedBinary "nixpkgs-fmt" host.nixpkgsFmt;
      deadnix = storedBinary "deadnix" host.deadnix;
      cargo-llvm-cov = throw "cargo-llvm-cov is not in kiln's host package set";

      # The host's manylinux wheels run on the host's glibc as they are: the
      # hook checks that every ELF file's libraries resolve, patching nothing.
      autoPatchelfHook = makeSetupHook { name = "auto-patchelf-check"; } (
        builtins.toFile "auto-patchelf-check.sh" ''
          kilnCheckLibrariesResolve() {
            local file
            while IFS= read -r -d "" file; do
              if head -c4 "$file" | grep -q ELF && ldd "$file" 2>&1 | grep -q "not found"; then
                echo "$file: libraries not found:" >&2
                ldd "$file" | grep "not found" >&2
                return 1
              fi
            done < <(find "$out" -type f -print0)
          }
          postFixupHooks+=(kilnCheckLibrariesResolve)
        ''
      );

      # nixpkgs' hook adds NixOS's driver folder to every ELF file's runpath.
      autoAddDriverRunpath =
        makeSetupHook
          {
            name = "add-driver-runpath";
            propagatedBuildInputs = [ (hostTool "patchelf" [ "patchelf" ]) ];
          }
          (
            builtins.toFile "add-driver-runpath.sh" ''
              kilnAddDriverRunpath() {
                local file
                while IFS= read -r -d "" file; do
                  if head -c4 "$file" | grep -q ELF; then
                    patchelf --add-rpath /run/opengl-driver/lib "$file"
                  fi
                done < <(find "$out" -type f -print0)
              }
              postFixupHooks+=(kilnAddDriverRunpath)
            ''
          );

      makeWrapper = makeSetupHook { name = "make-wrapper"; } ./make-wrapper.sh;

      writableTmpDirAsHomeHook = makeSetupHook { name = "writable-home"; } (
        builtins.toFile "writable-home.sh" ''
          export HOME="$TMPDIR/home"
          mkdir -p "$HOME"
        ''
      );

      rustPlatform = {
        inherit buildRustPackage;
        # libclang for bindgen: the host's (Debian's libclang-dev).
        bindgenHook = makeSetupHook { name = "bindgen-hook"; } (
          builtins.toFile "bindgen-hook.sh" ''
            export LIBCLANG_PATH=${host.libclang}
          ''
        );
      };

      # nixpkgs' own Rust, crane's default before overrideToolchain.
      rustc = rustToolchain;
      cargo = rustToolchain;
      clippy = rustToolchain;
      rustfmt = rustToolchain;
    }
    // import ../eval/scope.nix { inherit lib final; }
    // {
      "cudaPackages_${lib.replaceStrings [ "." ] [ "_" ] pins.cuda.version}" = cudaPackages;
    };

  # rust-overlay's toolchains download from static.rust-lang.org, which these
  # machines cannot reach: its rust-bin takes the host's instead.
  hostRust = _final: prev: {
    rust-bin = (prev.rust-bin or { }) // {
      inherit fromRustupToolchainFile;
    };
  };
in
lib.fix (lib.foldl' (base: overlay: lib.extends overlay base) basePackages (overlays ++ [ hostRust ]))
