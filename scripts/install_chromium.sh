#!/usr/bin/env bash
# Debian's headless-capable Chromium for the results-page test (tests/test_report_html.py).
# Idempotent: installs only when /usr/bin/chromium is missing; prints the version either way.
# Needs root (or sudo) and Debian's package registry.
set -euo pipefail

if [[ ! -x /usr/bin/chromium ]]; then
  SUDO=""
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || { echo "install_chromium.sh: needs root or sudo" >&2; exit 1; }
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
fi
/usr/bin/chromium --version
