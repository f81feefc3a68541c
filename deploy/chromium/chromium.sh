#!/usr/bin/env bash
# A headless browser for the HTML report's test (tests/guard/test_report.py): Debian's chromium.
#
#   deploy/chromium/chromium.sh     print the path of a chromium, installing Debian's package
#                                   first (apt-get, as root) when none is on PATH
#
# The tests call it themselves (as tests/sweeps/test_slurm.py calls deploy/slurm/slurm.sh), so
# the README's test command needs nothing installed by hand. Two pytest workers may call it at
# once: apt-get waits for the other's lock (DPkg::Lock::Timeout).
set -euo pipefail
log() { echo "chromium.sh: $*" >&2; }

if ! command -v chromium >/dev/null; then
  [[ $(id -u) -eq 0 ]] || { log "chromium is missing; run as root to install it (apt-get install chromium)"; exit 1; }
  command -v apt-get >/dev/null || { log "chromium is missing and there is no apt-get to install it"; exit 1; }
  log "installing chromium from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >&2
fi
command -v chromium
