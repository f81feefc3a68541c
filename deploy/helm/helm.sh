#!/usr/bin/env bash
# Helm, built from its Go module at a pinned version, cached in the repository.
#
#   deploy/helm/helm.sh path        print the helm binary's path (built first when missing)
#   deploy/helm/helm.sh ARGS...     run that helm with ARGS (e.g. lint deploy/helm/guard)
#
# No release binary can be downloaded here, but the Go module proxy is reachable: `go install`
# builds helm.sh/helm/v4/cmd/helm@$GUARD_HELM_VERSION into deploy/helm/.bin/ (ignored by git),
# so a second run reuses it (a fresh clone on the same machine rebuilds from Go's module and
# build caches, in seconds). The tests call it themselves (tests/deploy/test_helm.py), as they
# call deploy/tools/debian-tool.sh; two pytest workers may call it at once (a lock).
set -euo pipefail
log() { echo "helm.sh: $*" >&2; }
here=$(cd "$(dirname "$0")" && pwd)
version=${GUARD_HELM_VERSION:-v4.3.2}
bin_dir="$here/.bin"
helm="$bin_dir/helm-$version"

if [[ ! -x $helm ]]; then
  command -v go >/dev/null || {
    log "helm $version is not built and there is no Go toolchain to build it; install Go (helm $version needs 1.26; Go >= 1.21 fetches that toolchain itself through the module proxy) and run this again"
    exit 1
  }
  mkdir -p "$bin_dir"
  exec 9>"$bin_dir/.lock"
  flock 9
  if [[ ! -x $helm ]]; then
    log "building helm $version from helm.sh/helm/v4 (once; cached in $bin_dir)"
    t0=$SECONDS
    tmp=$(mktemp -d "$bin_dir/build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    # CGO off: a static binary; -trimpath/-s -w: smaller, reproducible
    if ! CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
        go install -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version" "helm.sh/helm/v4/cmd/helm@$version" >&2; then
      log "go install helm.sh/helm/v4/cmd/helm@$version failed (see above); is the Go module proxy reachable (go env GOPROXY)?"
      exit 1
    fi
    mv "$tmp/helm" "$helm"
    rm -rf "$tmp"
    trap - EXIT
    log "built $helm in $((SECONDS - t0)) s"
  fi
  exec 9>&-
fi

if [[ ${1:-} == path ]]; then
  echo "$helm"
else
  exec "$helm" "$@"
fi
