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
#   nodejs, npm               the dashboard's schema check
# Idempotent and quick when everything is present. On a busy machine it waits (at most 5 min)
# for dpkg's lock, saying who holds it, and retries a failed fetch (scripts/lib/apt.sh).
# Package post-install scripts may not start services meanwhile (a policy-rc.d, removed on
# every exit, failure included; one that was there before is put back).
#
#   DRY_RUN=1   say what would be installed and how, change nothing
#   PACKAGES="a b"   install these instead of the missing ones (tests)
#   POLICY_RC_D (/usr/sbin/policy-rc.d), and scripts/lib/apt.sh's knobs (tests)
set -euo pipefail
# shellcheck source=lib/apt.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"

need=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
if [ -n "${PACKAGES:-}" ]; then
  read -r -a need <<<"$PACKAGES"
else
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
fi
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
start=$SECONDS
echo "$APT_WHO: installing Debian packages: ${need[*]}"

# Packages whose post-install scripts would start a system service: none of that here; the
# tests start their own instances on free ports.
POLICY_RC_D=${POLICY_RC_D:-/usr/sbin/policy-rc.d}
saved=
restore_policy() {
  if [ -n "$saved" ]; then
    $SUDO mv -f "$saved" "$POLICY_RC_D"
  else
    $SUDO rm -f "$POLICY_RC_D"
  fi
}
trap 'exit 130' INT
trap 'exit 143' TERM
if [ "${DRY_RUN:-0}" != 1 ]; then
  if [ -e "$POLICY_RC_D" ]; then  # someone's own: kept aside, put back on exit
    saved="$POLICY_RC_D.slogate-saved"
    $SUDO mv -f "$POLICY_RC_D" "$saved"
  fi
  trap restore_policy EXIT
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY_RC_D" >/dev/null
  $SUDO chmod +x "$POLICY_RC_D"
fi

apt_run update -qq
apt_run install -y -qq --no-install-recommends "${need[@]}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "$APT_WHO: dry run: nothing installed"
else
  echo "$APT_WHO: installed ${need[*]} in $((SECONDS - start)) s"
fi
