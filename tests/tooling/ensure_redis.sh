#!/usr/bin/env bash
# Installs redis-server from Debian's packages when it is missing (a fresh machine has none).
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "redis-server is missing; install it (apt-get install redis-server) or run as root" >&2
  exit 1
fi
echo "installing redis-server with apt-get ..." >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq redis-server >/dev/null
# the package may try to start a system service on 6379; the tests never use it
command -v redis-server >/dev/null
