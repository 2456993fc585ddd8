#!/usr/bin/env bash
# Install the Debian packages the tests use for real (not mocked): promtool and the Prometheus
# server (package prometheus), and a headless browser for the dashboard tests (chromium,
# chromium-driver), and Redis for the fleet-wide team limits (redis-server). Idempotent: does
# nothing when every command is already present.
set -euo pipefail

need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "system-deps.sh: need root to install: ${need[*]} (or install them yourself)" >&2
    exit 1
fi
echo "system-deps.sh: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The package may start its own services; the tests start the servers they need themselves.
pkill -x prometheus 2>/dev/null || true
pkill -f prometheus-node-exporter 2>/dev/null || true
service redis-server stop >/dev/null 2>&1 || true
command -v promtool >/dev/null
