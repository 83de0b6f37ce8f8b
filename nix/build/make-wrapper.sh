# makeWrapper PROGRAM WRAPPER [--set NAME VALUE] [--set-default NAME VALUE]
#   [--prefix NAME SEP VALUE] [--run COMMAND]: a bash script at WRAPPER that
#   prepares the environment and execs PROGRAM (the options of nixpkgs'
#   makeWrapper that kiln's Nix files use).
makeWrapper() {
    local program="$1" wrapper="$2"
    shift 2
    local body=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --set)
                body+="export $2=$(printf '%q' "$3")"$'\n'
                shift 3
                ;;
            --set-default)
                body+="export $2=\"\${$2-$(printf '%q' "$3")}\""$'\n'
                shift 3
                ;;
            --prefix)
                body+="export $2=$(printf '%q' "$4")\${$2:+$(printf '%q' "$3")\$$2}"$'\n'
                shift 4
                ;;
            --run)
                body+="$2"$'\n'
                shift 2
                ;;
            *)
                echo "makeWrapper: unknown option $1" >&2
                return 1
                ;;
        esac
    done
    mkdir -p "$(dirname "$wrapper")"
    {
        echo "#!$BASH"
        printf '%s' "$body"
        echo "exec -a \"\$0\" $(printf '%q' "$program") \"\$@\""
    } >"$wrapper"
    chmod +x "$wrapper"
}
