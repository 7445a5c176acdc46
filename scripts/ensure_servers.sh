#!/usr/bin/env bash
# Installs redis-server (Debian package) for the Redis KV-store tests when it is missing and we can.
# Tests that need it skip with a stated reason when it is still absent.
set -u
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing redis-server for the Redis KV-store tests..."
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 \
      || echo "could not install redis-server; Redis tests will be skipped"
  else
    echo "redis-server not found and cannot be installed here; Redis tests will be skipped"
  fi
fi
exit 0
