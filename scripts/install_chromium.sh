#!/usr/bin/env bash
# Installs Debian's headless Chromium and its WebDriver for the browser test; does nothing when present.
set -euo pipefail

if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
  exit 0
fi

SUDO=""
if [[ "$(id -u)" != "0" ]]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# Recommends (upower, printing, mesa) are not needed headless; one font is, for readable screenshots.
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core
