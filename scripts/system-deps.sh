#!/usr/bin/env bash
# Installs the system packages the tests need when they are missing (CI runs as root):
# chromium, PostgreSQL, git, docker.io, debootstrap and docker-registry.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need+=(postgresql)
fi
command -v git >/dev/null 2>&1 || need+=(git)
# Docker back end tests: a private dockerd (started by tests/docker_env.py) and debootstrap for the local base image.
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
# the image job's push to a registry (tests/test_env_docker.py): Debian's registry on loopback
[ -x /usr/bin/docker-registry ] || command -v docker-registry >/dev/null 2>&1 || need+=(docker-registry)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing system packages: ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "warning: missing ${need[*]} (run as root or install them); dependent tests will skip" >&2
  fi
fi
