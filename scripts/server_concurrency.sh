#!/usr/bin/env bash
# Aggregate decode throughput of kiln-server at several concurrencies, for
# batch-1 serving (--batch-slots 1) and continuous batching, side by side in
# one run: for each slot count a server is started, `kiln-load` runs
# REQUESTS_PER_CLIENT x C streamed greedy requests of MAX_TOKENS tokens at
# each concurrency C, and the server is stopped.
#
#   SERVER=target/release/kiln-server LOAD=target/release/kiln-load \
#       SERVER_ARGS="--backend iree-cpu --max-context 256" SLOTS="1 8 32" \
#       CONCURRENCY="1 8 32" scripts/server_concurrency.sh
#
# LOAD is the kiln-load binary, LOAD_ARGS extra options for it
# (e.g. --allow-divergence); the table is printed last.
set -euo pipefail
: "${SERVER:?set SERVER to a kiln-server binary}" "${LOAD:?set LOAD to a kiln-load binary}"
slots_list=${SLOTS:-1 8 32}
concurrency_list=${CONCURRENCY:-1 8 32}
per_client=${REQUESTS_PER_CLIENT:-4}
max_tokens=${MAX_TOKENS:-64}
model_id=${MODEL_ID:-embedded}
port=${PORT:-8377}
logs=$(mktemp -d)
table=()

for slots in $slots_list; do
    # shellcheck disable=SC2086
    "$SERVER" ${SERVER_ARGS:-} --port "$port" --batch-slots "$slots" --queue-size 256 \
        > "$logs/server-$slots.log" 2>&1 &
    pid=$!
    # A failed load run stops the script: the server must not outlive it.
    trap 'kill "$pid" 2> /dev/null || true' EXIT
    # Ready once the model is loaded and its modules compiled or loaded.
    for _ in $(seq 1 1200); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        kill -0 "$pid" 2> /dev/null || { cat "$logs/server-$slots.log"; exit 1; }
        sleep 0.5
    done
    for c in $concurrency_list; do
        # shellcheck disable=SC2086
        out=$("$LOAD" ${LOAD_ARGS:-} --url "http://127.0.0.1:$port" --model "$model_id" \
            --requests $((per_client * c)) --concurrency "$c" --max-tokens "$max_tokens")
        echo "== slots $slots, concurrency $c"
        echo "$out"
        tps=$(sed -n 's/.*, \([0-9.]*\) generated tokens\/s/\1/p' <<< "$out")
        itl=$(sed -n 's/.*inter-token latency: p50 \([0-9.]*\) ms.*/\1/p' <<< "$out")
        ttft=$(sed -n 's/.*time to first token: p50 \([0-9.]*\) ms, p99 \([0-9.]*\) ms.*/\1 \/ \2/p' <<< "$out")
        table+=("| $slots | $c | $tps | $ttft | $itl |")
    done
    kill -TERM "$pid"
    wait "$pid" || true
done

echo
echo "| batch slots | concurrency | aggregate tok/s | first token p50 / p99 (ms) | inter-token p50 (ms) |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${table[@]}"
