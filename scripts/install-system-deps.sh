#!/usr/bin/env bash
# Installs the Debian packages the test suite needs, if they are missing. Idempotent and quick
# when everything is present.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)   # real Prometheus + promtool
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v gcc >/dev/null || need+=(gcc)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
