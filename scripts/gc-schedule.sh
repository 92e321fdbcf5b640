#!/usr/bin/env bash
# The schedule of `slurmckpt gc` on a node, the job epilog's safety net (docs/operations.md, "Packaging"):
# a systemd timer (etc/slurmckpt-gc.timer and .service) where systemd runs, an /etc/cron.d entry
# (etc/slurmckpt-gc.cron.in) elsewhere. make install (scripts/setup.sh gc-schedule) and the Debian package
# (scripts/build-deb.sh, both kinds: its cron entry does nothing where systemd runs) install them from here.
#   scripts/gc-schedule.sh KIND SLURMCKPT [DESTDIR]
#     KIND       systemd | cron | both | auto (systemd where /run/systemd/system exists, else cron)
#     SLURMCKPT  the slurmckpt command the entries run (absolute path)
#     DESTDIR    a staging root: files only. Without it, on this system: a timer is enabled and started.
#   UNITDIR      where the units go (default /usr/local/lib/systemd/system; the package: /usr/lib/systemd/system)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIND=${1:?usage: gc-schedule.sh systemd|cron|both|auto SLURMCKPT [DESTDIR]}
BIN=${2:?usage: gc-schedule.sh KIND SLURMCKPT [DESTDIR]}
DEST=${3:-}
UNITDIR=${UNITDIR:-/usr/local/lib/systemd/system}

die() { echo "gc-schedule: $*" >&2; exit 1; }
case $BIN in /*) ;; *) die "SLURMCKPT must be an absolute path (got '$BIN')" ;; esac
[[ "$BIN" =~ ^[A-Za-z0-9/._+-]+$ ]] || die "SLURMCKPT '$BIN': only letters, digits and / . _ + - (it goes into a unit and a crontab)"
if [ "$KIND" = auto ]; then
  if [ -d /run/systemd/system ]; then KIND=systemd; else KIND=cron; fi
fi
case $KIND in systemd|cron|both) ;; *) die "unknown KIND '$KIND' (systemd, cron, both or auto)" ;; esac

render() { sed "s#@SLURMCKPT@#$BIN#g" "$1"; }

if [ "$KIND" != cron ]; then
  install -d -m 0755 "$DEST$UNITDIR"
  render "$REPO/etc/slurmckpt-gc.service.in" >"$DEST$UNITDIR/slurmckpt-gc.service"
  install -m 0644 "$REPO/etc/slurmckpt-gc.timer" "$DEST$UNITDIR/slurmckpt-gc.timer"
  chmod 0644 "$DEST$UNITDIR/slurmckpt-gc.service"
  echo "$DEST$UNITDIR/slurmckpt-gc.service"
  echo "$DEST$UNITDIR/slurmckpt-gc.timer"
fi
if [ "$KIND" != systemd ]; then
  # cron reads /etc/cron.d files owned by root, not group/world-writable, without a dot in the name
  install -d -m 0755 "$DEST/etc/cron.d"
  render "$REPO/etc/slurmckpt-gc.cron.in" >"$DEST/etc/cron.d/slurmckpt"
  chmod 0644 "$DEST/etc/cron.d/slurmckpt"
  echo "$DEST/etc/cron.d/slurmckpt"
fi
if [ -z "$DEST" ] && [ "$KIND" != cron ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl enable --now slurmckpt-gc.timer >&2
fi
