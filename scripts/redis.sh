#!/usr/bin/env bash
# A private redis-server for tests and demos (loopback only, no persistence).
#
#   bash scripts/redis.sh start    # start if not running; prints redis://127.0.0.1:PORT/0
#   bash scripts/redis.sh stop
#   bash scripts/redis.sh status   # exit 0 if it answers PING
#   bash scripts/redis.sh url
#
# KVLENS_REDIS_PORT (default 6399) picks the port; files live in .run/redis-PORT/.
# From Python tests: subprocess.run(["bash", "scripts/redis.sh", "start"], check=True,
# capture_output=True, text=True).stdout.strip() is the URL.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${KVLENS_REDIS_PORT:-6399}"
DIR="${KVLENS_RUN_DIR:-$ROOT/.run}/redis-$PORT"
PIDFILE="$DIR/redis.pid"
URL="redis://127.0.0.1:$PORT/0"

ping() {
    # redis-cli comes with redis-server (redis-tools); fall back to a raw PING over bash's /dev/tcp.
    if command -v redis-cli >/dev/null 2>&1; then
        [ "$(redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null)" = PONG ]
    else
        local reply=""
        exec 3<>"/dev/tcp/127.0.0.1/$PORT" 2>/dev/null || return 1
        printf 'PING\r\n' >&3
        read -r -t 2 reply <&3 || true
        exec 3>&-
        [ "${reply%$'\r'}" = "+PONG" ]
    fi
}

case "${1:-}" in
    start)
        if ping; then echo "$URL"; exit 0; fi
        command -v redis-server >/dev/null 2>&1 ||
            { echo "redis-server is not installed (bash scripts/setup.sh installs it)" >&2; exit 1; }
        mkdir -p "$DIR"
        redis-server --bind 127.0.0.1 --port "$PORT" --daemonize yes --pidfile "$PIDFILE" \
            --dir "$DIR" --logfile "$DIR/redis.log" --save "" --appendonly no \
            --protected-mode yes >/dev/null
        for _ in $(seq 1 50); do
            if ping; then echo "$URL"; exit 0; fi
            sleep 0.1
        done
        echo "redis-server did not answer on port $PORT; log: $DIR/redis.log" >&2
        tail -n 20 "$DIR/redis.log" >&2 || true
        exit 1
        ;;
    stop)
        if [ -f "$PIDFILE" ]; then
            pid="$(cat "$PIDFILE")"
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            rm -f "$PIDFILE"
        fi
        ;;
    status) ping ;;
    url) echo "$URL" ;;
    *)
        echo "usage: $0 start|stop|status|url" >&2
        exit 2
        ;;
esac
