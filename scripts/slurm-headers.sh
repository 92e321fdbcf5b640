#!/usr/bin/env bash
# slurm-headers.sh SUITE DIR - Slurm's C headers of a Debian suite, for building the shim against another
# Slurm than the installed one (spank/Makefile: make SLURM_INCLUDE=DIR/usr/include; docs/slurm-versions.md).
#
#   SUITE  a Debian suite: bookworm (22.05), trixie (24.11), sid (the newest Debian has)
#   DIR    gets libslurm-dev's files (DIR/usr/include/slurm/{slurm,spank,slurm_version,...}.h) and
#          DIR/VERSION (the package version, e.g. 24.11.5-4+deb13u1)
#
# The host's apt state is never touched: apt-get runs with its own sources list, lists, cache and preferences
# under $SLURMCKPT_CACHE/slurm-headers/<suite>/apt (default /var/cache/slurmckpt), and checks the suite's
# signature with Debian's archive keyring as usual. The .deb stays in that cache; a second run with the same
# package version downloads only the index (apt-get update, a few MB) and re-extracts nothing.
# Runs as root or as any user who can write the cache directory.
set -euo pipefail
SUITE=${1:?usage: slurm-headers.sh SUITE DIR}
DIR=${2:?usage: slurm-headers.sh SUITE DIR}
MIRROR=${SLURMCKPT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=${SLURMCKPT_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
CACHE=${SLURMCKPT_CACHE:-/var/cache/slurmckpt}/slurm-headers/$SUITE
APT=$CACHE/apt
PKG=libslurm-dev   # holds every slurm/*.h, spank.h and slurm_version.h included

die() { echo "slurm-headers: $SUITE: $*" >&2; exit 1; }
case $SUITE in *[!a-z0-9-]*|'') die "not a Debian suite name";; esac
[ -r "$KEYRING" ] || die "$KEYRING missing (apt-get install debian-archive-keyring)"
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || die "needs apt-get and dpkg-deb (Debian)"

mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$APT/etc/preferences.d" "$APT/etc/sources.list.d" \
  "$CACHE/debs"
cat >"$APT/etc/sources.list" <<EOF
deb [signed-by=$KEYRING arch=amd64] $MIRROR $SUITE main
EOF
# Everything apt reads or writes lives under $APT; the host's apt.conf.d (proxy, Check-Valid-Until) still applies.
opts=(-o Dir::State="$APT" -o Dir::State::Lists="$APT/lists" -o Dir::State::status=/dev/null
  -o Dir::Cache="$APT" -o Dir::Cache::Archives="$APT/archives" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
  -o Dir::Etc::SourceList="$APT/etc/sources.list" -o Dir::Etc::SourceParts="$APT/etc/sources.list.d"
  -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts="$APT/etc/preferences.d"
  -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o Debug::NoLocking=1 -o Acquire::Languages=none
  -o APT::Sandbox::User=root)

log=$CACHE/apt.log
apt-get "${opts[@]}" -q update >"$log" 2>&1 || { tail -n 20 "$log" >&2; die "apt-get update failed ($MIRROR $SUITE)"; }
ver=$(apt-cache "${opts[@]}" show --no-all-versions "$PKG" 2>/dev/null | awk '/^Version:/ && !v {v = $2} END {print v}')
[ -n "$ver" ] || die "no $PKG in $MIRROR $SUITE main"

if [ -f "$DIR/VERSION" ] && [ "$(cat "$DIR/VERSION")" = "$ver" ] && [ -f "$DIR/usr/include/slurm/spank.h" ]; then
  echo "$ver"; exit 0
fi
deb=$(ls "$CACHE/debs/${PKG}_${ver//:/%3a}_"*.deb 2>/dev/null | head -n1 || true)
if [ -z "$deb" ]; then
  # apt-get download checks the .deb against the signed index; it writes to the current directory.
  (cd "$CACHE/debs" && apt-get "${opts[@]}" -q download "$PKG=$ver") >>"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; die "apt-get download $PKG=$ver failed"; }
  deb=$(ls "$CACHE/debs/${PKG}_"*.deb | grep -F "_${ver//:/%3a}_" | head -n1)
fi
rm -rf "$DIR"; mkdir -p "$DIR"
dpkg-deb -x "$deb" "$DIR" || die "dpkg-deb -x $deb failed"
[ -f "$DIR/usr/include/slurm/spank.h" ] && [ -f "$DIR/usr/include/slurm/slurm_version.h" ] \
  || die "$deb has no slurm/spank.h or slurm/slurm_version.h"
echo "$ver" >"$DIR/VERSION"
# Old .debs of this suite go; the one in use stays.
find "$CACHE/debs" -name "${PKG}_*.deb" ! -path "$deb" -delete
echo "$ver"
