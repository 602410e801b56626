# Sourced by scripts/test: a private redis-server for the storage tier's Redis tests.
#
# start_test_redis installs redis-server with apt-get when it is missing (CI runs as root and may
# reach the package registries), starts it on 127.0.0.1 on a free port with nothing persisted,
# and exports KVSHM_TEST_REDIS_URL, where the tests find it (tests/support/redis_server.rs). The server
# is stopped when the calling shell exits, however it exits: by an EXIT trap, and by a watchdog
# that kills it once the shell is gone (in case another trap replaces ours).

start_test_redis() {
    if ! command -v redis-server >/dev/null 2>&1; then
        echo "== installing redis-server (needed by the storage tests)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
            || { echo "cannot install redis-server: the Redis storage tests need it" >&2; return 1; }
    fi
    KVSHM_TEST_REDIS_DIR=$(mktemp -d /tmp/kvshm-test-redis.XXXXXX)
    local attempt port
    for attempt in 1 2 3 4 5 6 7 8; do
        port=$(( 20000 + (RANDOM * 32768 + RANDOM) % 40000 ))
        redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
            --protected-mode no --daemonize no --loglevel warning --dir "$KVSHM_TEST_REDIS_DIR" \
            >"$KVSHM_TEST_REDIS_DIR/redis.log" 2>&1 &
        KVSHM_TEST_REDIS_PID=$!
        local waited=0
        while kill -0 "$KVSHM_TEST_REDIS_PID" 2>/dev/null && [ "$waited" -lt 100 ]; do
            if [ "$(redis-cli -p "$port" ping 2>/dev/null)" = "PONG" ]; then
                export KVSHM_TEST_REDIS_URL="redis://127.0.0.1:$port"
                trap stop_test_redis EXIT
                # The watchdog: stops the server once this shell is gone.
                ( shell=$$; server=$KVSHM_TEST_REDIS_PID
                  while kill -0 "$shell" 2>/dev/null; do sleep 2; done
                  kill "$server" 2>/dev/null ) >/dev/null 2>&1 &
                echo "== redis-server $(redis-server --version | awk '{print $3}' | sed 's/^v=//') for the tests at $KVSHM_TEST_REDIS_URL"
                return 0
            fi
            sleep 0.1
            waited=$((waited + 1))
        done
        kill "$KVSHM_TEST_REDIS_PID" 2>/dev/null || true
        wait "$KVSHM_TEST_REDIS_PID" 2>/dev/null || true
    done
    echo "could not start redis-server for the tests:" >&2
    cat "$KVSHM_TEST_REDIS_DIR/redis.log" >&2
    return 1
}

stop_test_redis() {
    if [ -n "${KVSHM_TEST_REDIS_PID:-}" ]; then
        kill "$KVSHM_TEST_REDIS_PID" 2>/dev/null || true
        wait "$KVSHM_TEST_REDIS_PID" 2>/dev/null || true
        KVSHM_TEST_REDIS_PID=
    fi
    [ -n "${KVSHM_TEST_REDIS_DIR:-}" ] && rm -rf "$KVSHM_TEST_REDIS_DIR"
    return 0
}
