# The build script of every derivation in kiln's host-backed package set
# (nix/build/host-nixpkgs.nix): nixpkgs' generic build, written for the parts
# crane and kiln's Nix files use. A derivation runs `bash -e setup.sh`; the
# environment is the derivation's attributes (lists as space-separated
# words, true as 1, false as empty), as Nix passes them.
#
# What it does, in nixpkgs' order and with nixpkgs' names, so crane's setup
# hooks and kiln's phases run unchanged:
#   1. PATH from `initialPath` (the host's tool folders) and the inputs' bin/;
#      each input's nix-support/setup-hook sourced, propagated inputs first.
#   2. `buildCommand` alone, when set; otherwise the phases: unpack, patch,
#      configure, build, check, install, fixup, installCheck. A phase given as
#      an attribute replaces the default; `dontX`/`doCheck`/`doInstallCheck`
#      switch them; `runHook NAME` runs the attribute or function NAME, then
#      each entry of the array NAMEHooks that setup hooks filled.
# What it does not do (and nixpkgs' stdenv does): no compiler wrapper, no
# hardening flags, no stripping, no shebang patching. The compilers are the
# host's (initialPath).

# shellcheck disable=SC2154 # initialPath, out and the rest come from Nix.

set -o pipefail
shopt -s nullglob

export PATH="$initialPath"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-315532800}"
export NIX_BUILD_CORES="${NIX_BUILD_CORES:-1}"
[ "$NIX_BUILD_CORES" = 0 ] && NIX_BUILD_CORES="$(nproc)"
# Nix sets HOME to a folder that must not exist; tools that need one get
# writableTmpDirAsHomeHook, as in nixpkgs.

# Hook arrays the setup hooks append to.
for phaseName in Unpack Patch Configure Build Check Install Fixup InstallCheck; do
    declare -a "pre${phaseName}Hooks=()" "post${phaseName}Hooks=()"
done
# shellcheck disable=SC2034 # filled by setup hooks, run by runHook.
declare -a fixupOutputHooks=()

# runHook NAME [ARGS]: the attribute or function NAME, then NAMEHooks.
runHook() {
    local name="$1"
    shift
    if declare -F "$name" >/dev/null; then
        "$name" "$@"
    elif [ -n "${!name:-}" ]; then
        eval "${!name}"
    fi
    local hooks="${name}Hooks[@]"
    local hook
    for hook in "${!hooks}"; do
        if declare -F "$hook" >/dev/null; then
            "$hook" "$@"
        else
            eval "$hook"
        fi
    done
    return 0
}

# Inputs: each folder once, its propagated inputs before it.
declare -A seenInputs=()
addInput() {
    local input="$1"
    [ -n "${seenInputs[$input]:-}" ] && return 0
    seenInputs[$input]=1
    local propagated="$input/nix-support/propagated-build-inputs"
    if [ -f "$propagated" ]; then
        local p
        for p in $(<"$propagated"); do
            addInput "$p"
        done
    fi
    [ -d "$input/bin" ] && PATH="$input/bin:$PATH"
    [ -d "$input/lib/pkgconfig" ] && export PKG_CONFIG_PATH="$input/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    if [ -f "$input/nix-support/setup-hook" ]; then
        # shellcheck disable=SC1091
        source "$input/nix-support/setup-hook"
    fi
}
for input in ${depsBuildBuild:-} ${nativeBuildInputs:-} ${buildInputs:-} ${propagatedNativeBuildInputs:-} ${propagatedBuildInputs:-}; do
    addInput "$input"
done
export PATH

# substitute IN OUT --replace-fail FROM TO ... (nixpkgs' substitute, the
# replacement kind crane and kiln use).
substitute() {
    local input="$1" output="$2"
    shift 2
    local text
    text="$(cat "$input"; echo x)"
    text="${text%x}"
    while [ $# -gt 0 ]; do
        case "$1" in
            --replace-fail | --replace)
                if [ "$1" = --replace-fail ] && [[ "$text" != *"$2"* ]]; then
                    echo "substitute: $input does not contain '$2'" >&2
                    return 1
                fi
                text="${text//"$2"/"$3"}"
                shift 3
                ;;
            *)
                echo "substitute: unknown option $1" >&2
                return 1
                ;;
        esac
    done
    printf '%s' "$text" >"$output.tmp" && mv "$output.tmp" "$output"
}
substituteInPlace() {
    local file="$1"
    shift
    substitute "$file" "$file" "$@"
}

unpackFile() {
    local file="$1"
    echo "unpacking $file"
    if [ -d "$file" ]; then
        # The copy gets the source's base name without the store hash.
        local name
        name="$(basename "$file")"
        name="${name#*-}"
        cp -r --no-preserve=mode,ownership "$file" "$name"
        chmod -R u+w "$name"
        return
    fi
    case "$file" in
        *.zip | *.whl) unzip -q "$file" ;;
        *.tar | *.tar.* | *.tgz | *.crate) tar -xf "$file" --no-same-owner --no-same-permissions ;;
        *)
            echo "unpackPhase: do not know how to unpack $file" >&2
            return 1
            ;;
    esac
}

defaultUnpackPhase() {
    runHook preUnpack
    local before
    before="$(ls -A)"
    local source
    for source in ${srcs:-${src:?no src and no unpackPhase}}; do
        unpackFile "$source"
    done
    if [ -z "${sourceRoot:-}" ]; then
        local made=()
        local entry
        for entry in *; do
            [ -d "$entry" ] && ! grep -qxF "$entry" <<<"$before" && made+=("$entry")
        done
        if [ "${#made[@]}" -ne 1 ]; then
            echo "unpackPhase: the sources made ${#made[@]} folders (${made[*]}); set sourceRoot" >&2
            return 1
        fi
        sourceRoot="${made[0]}"
    fi
    chmod -R u+w -- "$sourceRoot"
    runHook postUnpack
}

defaultPatchPhase() {
    runHook prePatch
    local patch
    for patch in ${patches:-}; do
        echo "applying $patch"
        patch -p1 --batch <"$patch"
    done
    runHook postPatch
}

defaultConfigurePhase() {
    runHook preConfigure
    runHook postConfigure
}

defaultBuildPhase() {
    runHook preBuild
    if [ -f Makefile ]; then
        make -j "$NIX_BUILD_CORES"
    fi
    runHook postBuild
}

defaultCheckPhase() {
    runHook preCheck
    runHook postCheck
}

defaultInstallPhase() {
    runHook preInstall
    if [ -f Makefile ]; then
        make install
    fi
    runHook postInstall
}

# What nixpkgs' fixup does that other derivations rely on: the setup hook
# and propagated inputs written where addInput reads them.
defaultFixupPhase() {
    runHook preFixup
    local output
    for output in ${outputs:-out}; do
        [ -e "${!output}" ] || continue
        prefix="${!output}" runHook fixupOutput
    done
    if [ -n "${setupHook:-}" ]; then
        mkdir -p "$out/nix-support"
        cp "$setupHook" "$out/nix-support/setup-hook"
    fi
    if [ -n "${propagatedBuildInputs:-}${propagatedNativeBuildInputs:-}" ]; then
        mkdir -p "$out/nix-support"
        echo "${propagatedNativeBuildInputs:-} ${propagatedBuildInputs:-}" >"$out/nix-support/propagated-build-inputs"
    fi
    runHook postFixup
}

defaultInstallCheckPhase() {
    runHook preInstallCheck
    runHook postInstallCheck
}

# runPhase NAME SWITCH: the phase's attribute if given, else its default.
runPhase() {
    local phase="$1"
    local phaseAttribute="${phase}Phase"
    echo "=== $phase"
    if [ -n "${!phaseAttribute:-}" ]; then
        eval "${!phaseAttribute}"
    else
        local default="default${phase^}Phase"
        "$default"
    fi
}

genericBuild() {
    if [ -n "${buildCommand:-}" ]; then
        eval "$buildCommand"
        return
    fi
    [ -z "${dontUnpack:-}" ] && runPhase unpack
    if [ -n "${sourceRoot:-}" ]; then
        cd "$sourceRoot" || return 1
    fi
    [ -z "${dontPatch:-}" ] && runPhase patch
    [ -z "${dontConfigure:-}" ] && runPhase configure
    [ -z "${dontBuild:-}" ] && runPhase build
    [ -n "${doCheck:-}" ] && runPhase check
    [ -z "${dontInstall:-}" ] && runPhase install
    [ -z "${dontFixup:-}" ] && runPhase fixup
    [ -n "${doInstallCheck:-}" ] && runPhase installCheck
    return 0
}

# The dev shell sources this file without building.
if [ -z "${kilnSetupOnly:-}" ]; then
    cd "${TMPDIR:-/tmp}" || exit 1
    genericBuild
fi
