#!/usr/bin/env bash
# Guard's images by role, built with Debian's buildah on a Debian base made by debootstrap
# (no image registry is needed: the base comes from Debian's packages, Guard's dependencies
# from PyPI).
#
#   deploy/images/build.sh ROLE     build localhost/guard-ROLE (agent | services | sweep), check
#                                   it, print one JSON line: image, size_mb (unpacked),
#                                   env_mb (/opt/guard), built, build_s
#
# ROLE's Containerfile is deploy/images/Containerfile.ROLE (services: the repository's
# Dockerfile). The base,
# localhost/guard-base:bookworm (debootstrap --variant=minbase bookworm + python3 and its venv
# module), is made once and kept in buildah's store; an image is tagged with a hash of what
# goes into it (Containerfile, base, pyproject.toml and the package sources), so an unchanged
# tree is not built twice. After the build, the image's `guard ROLE --help` must run in it
# (and for the agent, one sampling cycle: `guard agent --once --dry-run`), and its size must
# be at most GUARD_IMAGE_MAX_MB (agent: 250).
#
# Runs as root with buildah's chroot isolation (no user namespaces; the default OCI isolation
# fails on a cgroup v1/v2 hybrid host: "crun: cgroups in hybrid mode not supported, drop all
# controllers from cgroupv2"), on buildah's default overlay storage; buildah and
# debootstrap come from Debian when missing (deploy/tools/debian-tool.sh). The build's RUN
# steps see this host's CA bundle (a TLS-intercepting proxy's CA, where there is one) through
# a read-only mount that is not part of the image.
set -euo pipefail
log() { echo "build.sh: $*" >&2; }
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
[[ $# -eq 1 && $1 =~ ^(agent|services|sweep)$ ]] || { log "usage: build.sh agent|services|sweep"; exit 2; }
role=$1
[[ $(id -u) -eq 0 ]] || { log "needs root (buildah with chroot isolation, debootstrap)"; exit 1; }

tool() { deploy/tools/debian-tool.sh "$1" "$2" >/dev/null; }
tool buildah buildah
export BUILDAH_ISOLATION=chroot
mirror=${GUARD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
base=localhost/guard-base:bookworm
t0=$SECONDS

# --- the base: debootstrap into a scratch container's root, committed once -------------------
exec 9>/tmp/guard-image-base.lock
flock 9
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  tool debootstrap debootstrap
  log "making $base with debootstrap (once; kept in buildah's store)"
  ctr=$(buildah from scratch)
  trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  mnt=$(buildah mount "$ctr")
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$mnt" "$mirror" >&2
  rm -rf "$mnt"/var/cache/apt/archives/*.deb "$mnt"/var/lib/apt/lists/* \
    "$mnt"/usr/share/doc/* "$mnt"/usr/share/man/* "$mnt"/usr/share/locale/*
  buildah umount "$ctr" >/dev/null
  buildah config --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
  buildah commit --quiet "$ctr" "$base" >/dev/null
  buildah rm "$ctr" >/dev/null
  trap - EXIT
  log "base made in $((SECONDS - t0)) s"
fi
exec 9>&-

# --- the role's image, tagged by what goes into it ----------------------------------------------
containerfile=deploy/images/Containerfile.$role
[[ $role == services ]] && containerfile=Dockerfile   # the repository's own image
sources=(pyproject.toml README.md guard schemas detectors agents streams sweeps evaluation planning)
tag=$(
  {
    buildah inspect --type image --format '{{.FromImageID}}' "$base"
    sha256sum "$containerfile"
    find "${sources[@]}" -type f -not -path '*/__pycache__/*' -not -name '*.pyc' -print0 \
      | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
)
image=localhost/guard-$role:src-$tag
built=false
if ! buildah inspect --type image "$image" >/dev/null 2>&1; then
  log "building $image from $containerfile"
  ca=()
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] \
    && ca=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
  buildah build --quiet --isolation chroot "${ca[@]}" --build-arg "BASE=$base" \
    -f "$containerfile" -t "$image" . >&2
  buildah tag "$image" "localhost/guard-$role:latest"
  built=true
  # the images of earlier trees: their layers would pile up in the store
  buildah images --noheading --format '{{.Name}}:{{.Tag}}' \
    | grep "^localhost/guard-$role:src-" | grep -v ":src-$tag\$" \
    | xargs -r buildah rmi >/dev/null 2>&1 || true
fi

# --- checks: the role's command runs in the image; its size --------------------------------------
ctr=$(buildah from "$image")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
run() { buildah run --isolation chroot "$ctr" -- "$@"; }
case $role in
  agent)
    run guard agent --help >/dev/null
    # one sampling cycle, printed instead of published: the agent's runtime imports, not
    # just its parser (no GPU here: --gpu-source none; NICs: whatever /sys shows)
    run guard agent --once --dry-run --gpu-source none --node image-check >/dev/null ;;
  services)
    for command in streams sink orchestrator; do run guard "$command" --help >/dev/null; done ;;
  sweep)
    run guard sweep run --help >/dev/null ;;
esac
[[ $(run id -u) -ne 0 ]] || { log "$image runs as root"; exit 1; }
# the unpacked image's root, as a node stores it, and Guard's environment within it
mnt=$(buildah mount "$ctr")
size_mb=$(du -sxm "$mnt" | cut -f1)
env_mb=$(du -sxm "$mnt/opt/guard" | cut -f1)
buildah umount "$ctr" >/dev/null
case $role in agent) limit=${GUARD_IMAGE_MAX_MB:-250} ;; *) limit=${GUARD_IMAGE_MAX_MB:-0} ;; esac
if [[ $limit -gt 0 && $size_mb -gt $limit ]]; then
  log "$image is $size_mb MB, over $limit MB (GUARD_IMAGE_MAX_MB)"
  exit 1
fi
printf '{"image": "%s", "size_mb": %s, "env_mb": %s, "built": %s, "build_s": %s}\n' \
  "$image" "$size_mb" "$env_mb" "$built" "$((SECONDS - t0))"
