#!/usr/bin/env bash
# Build slurmckpt's Debian package with dpkg-deb (no debhelper; docs/operations.md, "Packaging"):
#   the Python package for Debian's python3 (its dependencies are Debian packages), the SPANK plugin, the
#   proctrack plugin and the namespace init built against this host's Slurm headers (Slurm loads a plugin only
#   for the Slurm version it was built for: the package depends on exactly that libslurm), the config
#   template, cli_filter.lua, the man pages built from the code, the licence, and the schedule of `slurmckpt gc`
#   (a systemd timer, enabled where systemd runs, and an /etc/cron.d entry that does nothing there).
#   scripts/build-deb.sh [OUTDIR]      (default build/; prints the .deb's path)
set -euo pipefail
umask 022
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${1:-$REPO/build}" && cd "${1:-$REPO/build}" && pwd)
VERSION=$(sed -nE 's/^__version__ = "([^"]+)"/\1/p' "$REPO/src/slurmckpt/__init__.py")
ARCH=$(dpkg --print-architecture)
MULTIARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
STAGE=$OUT/deb-root
SPANK=$OUT/deb-spank
DEB=$OUT/slurmckpt_${VERSION}_${ARCH}.deb
# Reproducible: every date in the package is the last commit's.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || date +%s)}

die() { echo "build-deb: $*" >&2; exit 1; }
[ -n "$VERSION" ] || die "no __version__ in src/slurmckpt/__init__.py"

# The Slurm this builds for: its version (plugin_version) and the package of its library.
version_h=/usr/include/slurm/slurm_version.h
[ -f "$version_h" ] || die "$version_h missing: install libslurm-dev"
num=$(awk '/#define SLURM_VERSION_NUMBER/ {print $3}' "$version_h")
SLURM_VER=$(( (num >> 16) & 255 )).$(printf '%02d' $(( (num >> 8) & 255 ))).$(( num & 255 ))
LIBSLURM=$(dpkg-query -S "/usr/lib/$MULTIARCH/libslurm.so.*" 2>/dev/null | sed -n '1s/:.*//p')
[ -n "$LIBSLURM" ] || die "no Debian package owns /usr/lib/$MULTIARCH/libslurm.so.*"
next_micro=${SLURM_VER%.*}.$(( ${SLURM_VER##*.} + 1 ))

rm -rf "$STAGE" "$SPANK"
mkdir -p "$STAGE/DEBIAN"

# 1. C parts, in a copy of spank/ (the tree's own build keeps make install's paths).
cp -a "$REPO/spank" "$SPANK"
make -s -C "$SPANK" clean >/dev/null
# CPPFLAGS from the environment: spank/Makefile appends it to its own flags.
CPPFLAGS="-DARGS_DEFAULT_WRAPPER='\"/usr/bin/slurmckpt-wrap\"' -DARGS_DEFAULT_AGENT='\"/usr/bin/slurmckpt\"'"
CPPFLAGS+=" -DARGS_DEFAULT_INIT='\"/usr/libexec/slurmckpt/slurmckpt-init\"'"
CPPFLAGS=$CPPFLAGS make -s -C "$SPANK" all CONFIG=/etc/slurmckpt/slurmckpt.yaml >/dev/null
install -D -m 0644 "$SPANK/slurmckpt_spank.so" "$STAGE/usr/lib/slurmckpt/slurmckpt_spank.so"
install -D -m 0644 "$SPANK/proctrack_slurmckpt.so" "$STAGE/usr/lib/slurmckpt/proctrack_slurmckpt.so"
install -D -m 0755 "$SPANK/slurmckpt-init" "$STAGE/usr/libexec/slurmckpt/slurmckpt-init"
strip --strip-unneeded "$STAGE"/usr/lib/slurmckpt/*.so "$STAGE/usr/libexec/slurmckpt/slurmckpt-init"

# 2. The Python package for /usr/bin/python3, and its two commands.
site=$STAGE/usr/lib/python3/dist-packages
mkdir -p "$site"
(cd "$REPO/src" && find slurmckpt -name '*.py' -print0 | xargs -0 -I{} install -D -m 0644 {} "$site/{}")
mkdir -p "$STAGE/usr/bin"
for cmd in "slurmckpt:slurmckpt.cli" "slurmckpt-wrap:slurmckpt.task.wrapper"; do
  printf '#!/usr/bin/python3\nfrom %s import main\n\nmain()\n' "${cmd#*:}" >"$STAGE/usr/bin/${cmd%%:*}"
  chmod 0755 "$STAGE/usr/bin/${cmd%%:*}"
done
# the srun an MPI launcher in a batch step finds first (config srun_standin_dir; docs/mpi.md)
PYTHONPATH=$REPO/src /usr/bin/python3 -c 'import sys; from slurmckpt.task.srun_standin import install; install(*sys.argv[1:])' \
  "$STAGE/usr/libexec/slurmckpt/standin" /usr/bin/python3 >/dev/null

# 3. Man pages, built from the commands and the Config dataclass (one source).
PYTHONPATH=$REPO/src /usr/bin/python3 -m slurmckpt.cli.manpage "$OUT/man" >/dev/null
install -D -m 0644 "$OUT/man/slurmckpt.1" "$STAGE/usr/share/man/man1/slurmckpt.1"
install -D -m 0644 "$OUT/man/slurmckpt.yaml.5" "$STAGE/usr/share/man/man5/slurmckpt.yaml.5"
gzip -9n "$STAGE/usr/share/man/man1/slurmckpt.1" "$STAGE/usr/share/man/man5/slurmckpt.yaml.5"

# 4. What admins put in place (postinst installs the config only where there is none).
share=$STAGE/usr/share/slurmckpt
install -D -m 0644 "$REPO/etc/slurmckpt.yaml" "$share/slurmckpt.yaml"
install -D -m 0644 "$REPO/etc/cli_filter.lua" "$share/cli_filter.lua"
printf '%s\n' "# The one line that enables slurmckpt (add it to plugstack.conf, or include this file from it)." \
  "required /usr/lib/slurmckpt/slurmckpt_spank.so wrapper=/usr/bin/slurmckpt-wrap agent=/usr/bin/slurmckpt init=/usr/libexec/slurmckpt/slurmckpt-init" \
  >"$share/plugstack.conf"
# the job epilog's safety net: `slurmckpt gc` hourly on every node (scripts/gc-schedule.sh)
UNITDIR=/usr/lib/systemd/system bash "$REPO/scripts/gc-schedule.sh" both /usr/bin/slurmckpt "$STAGE" >/dev/null
doc=$STAGE/usr/share/doc/slurmckpt
install -D -m 0644 "$REPO/README.md" "$doc/README.md"
install -D -m 0644 "$REPO/docs/operations.md" "$doc/operations.md"
{ printf 'Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nUpstream-Name: slurmckpt\n\n'
  printf 'Files: *\nCopyright: the slurmckpt authors\nLicense: Apache-2.0\n See /usr/share/common-licenses/Apache-2.0.\n'; } \
  >"$doc/copyright"

# 5. Package metadata.
cat >"$STAGE/DEBIAN/control" <<EOF
Package: slurmckpt
Version: $VERSION
Architecture: $ARCH
Maintainer: slurmckpt developers <dev@slurmckpt.invalid>
Section: admin
Priority: optional
Depends: python3 (>= 3.11), python3-click (>= 8), python3-yaml (>= 6), python3-xxhash (>= 3), python3-psutil (>= 5.9), python3-zstandard (>= 0.20), slurm-client, iproute2, $LIBSLURM (>= $SLURM_VER), $LIBSLURM (<< $next_micro~)
Suggests: criu (>= 4.1), prometheus-node-exporter
Installed-Size: $(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
Homepage: https://slurmckpt.invalid
Description: transparent checkpoint/restore for Slurm jobs
 A SPANK plugin, a root agent per task (CRIU and the CUDA driver checkpoint
 API) and a job coordinator capture every process of a job at one consistent
 point and restore it when Slurm requeues the job. Built for Slurm $SLURM_VER.
 Needs CRIU >= 4.1 (Debian 12's 3.17 fails on recent kernels).
EOF
cat >"$STAGE/DEBIAN/postinst" <<'EOF'
#!/bin/sh
# Directories slurmckpt writes, and the config from its template where none exists; nothing existing is
# changed (docs/operations.md, "Packaging").
set -e
if [ "$1" = configure ]; then
    [ -d /var/lib/slurmckpt ] || install -d -m 0755 /var/lib/slurmckpt
    [ -d /var/lib/slurmckpt/images ] || install -d -m 0700 /var/lib/slurmckpt/images
    [ -d /var/lib/slurmckpt/summaries ] || install -d -m 0755 /var/lib/slurmckpt/summaries
    [ -d /var/log/slurmckpt ] || install -d -m 0700 /var/log/slurmckpt
    if [ ! -e /etc/slurmckpt/slurmckpt.yaml ]; then
        install -d -m 0755 /etc/slurmckpt
        sed 's#/usr/local/libexec/slurmckpt/#/usr/libexec/slurmckpt/#' /usr/share/slurmckpt/slurmckpt.yaml \
            >/etc/slurmckpt/slurmckpt.yaml
    fi
    # slurmckpt gc hourly: the timer where systemd runs (the cron entry then does nothing)
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
        systemctl enable --now slurmckpt-gc.timer || true
    elif command -v systemctl >/dev/null 2>&1; then
        systemctl enable slurmckpt-gc.timer >/dev/null 2>&1 || true
    fi
fi
EOF
cat >"$STAGE/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl disable --now slurmckpt-gc.timer || true
fi
EOF
cat >"$STAGE/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = purge ]; then
    rm -f /etc/systemd/system/timers.target.wants/slurmckpt-gc.timer
fi
EOF
echo /etc/cron.d/slurmckpt >"$STAGE/DEBIAN/conffiles"
chmod 0755 "$STAGE/DEBIAN/postinst" "$STAGE/DEBIAN/prerm" "$STAGE/DEBIAN/postrm"
(cd "$STAGE" && find usr -type f -print0 | sort -z | xargs -0 md5sum) >"$STAGE/DEBIAN/md5sums"
find "$STAGE" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
