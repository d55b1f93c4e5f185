#!/usr/bin/env bash
# Install headless Chromium and its WebDriver for the browser tests (tests/test_report_browser.py).
# Idempotent: does nothing when both are already on PATH. Needs root (or sudo) and apt;
# elsewhere it says so and exits 0, and the browser tests then skip with that reason.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

if have chromium && have chromedriver; then
    exit 0
fi
if ! have apt-get; then
    echo "install-browser: no apt-get here; install chromium and chromium-driver yourself" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-browser: not root and no password-less sudo; browser tests will skip" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver
