#!/usr/bin/env bash
# Installs redis-server (and redis-cli, which builds the test cluster) from Debian's packages
# when missing (a fresh machine has neither), and openssl, which makes the throwaway CA of the
# TLS Redis that the secure store runs use.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
  && command -v openssl >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "redis-server is missing; install it (apt-get install redis-server) or run as root" >&2
  exit 1
fi
echo "installing redis-server with apt-get ..." >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq redis-server redis-tools openssl >/dev/null
# the package may try to start a system service on 6379; the tests never use it
command -v redis-server >/dev/null
command -v redis-cli >/dev/null
command -v openssl >/dev/null
