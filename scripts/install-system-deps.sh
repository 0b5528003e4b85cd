#!/usr/bin/env bash
# Installs the Debian packages the test suite drives for real, if they are missing:
#   prometheus (+ promtool)   metrics scraping, rule unit tests
#   prometheus-alertmanager   amtool check-config of dashboards/alertmanager.yml
#   nginx                     the gateway behind a real reverse proxy
#   redis-server              shared admission state across gateway processes
#   docker-compose            `docker-compose config` validation of the stack (no engine needed)
#   cmake, g++, gcc           building llama.cpp's server for the real-engine test
#   chromium, chromium-driver the live console's browser test (Selenium drives Debian's
#                             chromium through its matching chromedriver)
#   fonts-dejavu-core         a font for that headless chromium (its fonts are only recommended)
# Idempotent and quick when everything is present.
set -euo pipefail
need=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
have prometheus || need+=(prometheus)
have amtool || need+=(prometheus-alertmanager)   # amtool check-config of the shipped config
have nginx || need+=(nginx)
have redis-server || need+=(redis-server)
have docker-compose || need+=(docker-compose)
have cmake || need+=(cmake)
have g++ || need+=(g++)
have gcc || need+=(gcc)
have node || need+=(nodejs)
have npm || need+=(npm)
have chromium || need+=(chromium)
have chromedriver || need+=(chromium-driver)
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -qq
# Packages whose post-install scripts would start a system service: none of that here; the
# tests start their own instances on free ports.
printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
$SUDO chmod +x /usr/sbin/policy-rc.d
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
$SUDO rm -f /usr/sbin/policy-rc.d
