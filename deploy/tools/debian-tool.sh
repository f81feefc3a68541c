#!/usr/bin/env bash
# A tool the tests use, from Debian's packages when it is missing.
#
#   deploy/tools/debian-tool.sh COMMAND PACKAGE   print COMMAND's path, installing PACKAGE first
#                                                 (apt-get, as root) when COMMAND is not on PATH
#
# The tests call it themselves (as tests/sweeps/test_slurm.py calls deploy/slurm/slurm.sh), so
# the README's test command needs nothing installed by hand: chromium for the HTML report,
# systemd-analyze (package systemd) for the units, java and mvn for a broker of a test's own.
# Two pytest workers may call it at once: apt-get waits for the other's lock.
set -euo pipefail
log() { echo "debian-tool.sh: $*" >&2; }
[[ $# -eq 2 ]] || { log "usage: debian-tool.sh COMMAND PACKAGE"; exit 2; }
command=$1 package=$2

if ! command -v "$command" >/dev/null; then
  [[ $(id -u) -eq 0 ]] || { log "$command is missing; run as root to install it (apt-get install $package)"; exit 1; }
  command -v apt-get >/dev/null || { log "$command is missing and there is no apt-get to install $package"; exit 1; }
  log "installing $package from Debian (for $command)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$package" >&2
fi
command -v "$command"
