#!/usr/bin/env bash
# slurmckpt set-up: packages, CRIU >= 4.1, Python venv, SPANK plugin, users, config, and a running Slurm test
# cluster (munged, mariadbd, slurmdbd, slurmctld, slurmd). Idempotent; the second run is fast.
#
#   scripts/setup.sh              everything (what `make setup` runs)
#   scripts/setup.sh STEP...      only the named steps, in the order given:
#                                 packages criu python spank users files slurm-config cluster smoke
#                                 gc-schedule (not in the default list; `make install`): `slurmckpt gc` hourly,
#                                 a systemd timer where systemd runs, else /etc/cron.d/slurmckpt
#                                 torch (not in the default list; `make test`): PyTorch's CPU build in a
#                                 venv of its own for the tests' torch.distributed jobs
#                                 criu-build (not in the default list): build and cache CRIU without
#                                 installing or checking it, for an image build (docker-slurm/), where
#                                 `criu check` cannot run: it needs the privileges of the node that runs it
# Environment:
#   NODES=N                       1 (default): one slurmd on the host, node name node1, address 127.0.0.1.
#                                 N>1: node1..nodeN, one slurmd per network namespace, 10.77.0.<i>/24 on
#                                 bridge ckptbr0 (host side 10.77.0.254, where slurmctld listens).
#   SLURMCKPT_KEEP_CONFIG=1       keep an existing /etc/slurmckpt/slurmckpt.yaml (make install)
#   SLURMCKPT_PACKAGES="G..."     package groups of scripts/packages.sh (default: node criu-build test storage ops)
#   SLURMCKPT_DEV_ALLOW_MISSING=1 developer escape hatch: warn instead of failing when pyproject.toml or
#                                 spank/Makefile is missing (the SPANK line in plugstack.conf is then commented out).
set -euo pipefail
umask 022

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$REPO/scripts/lib.sh"

NODES=${NODES:-1}
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] || die "NODES must be a number from 1 to 99 (got '$NODES')"
ALLOW_MISSING=${SLURMCKPT_DEV_ALLOW_MISSING:-0}
CRIU_MIN=4.1
# Set-up's own state and logs: a root-owned 0700 directory, never a fixed name in a world-writable /tmp that
# another user could pre-create as a symlink (root would then write through it).
SETUP_STATE=/var/lib/slurmckpt/setup      # made by main()
CRIU_READY_FILE=$SETUP_STATE/criu.ready
CRIU_CHECK_LOG=$SETUP_STATE/criu-check.log
SPANK_BUILD_LOG=$SETUP_STATE/spank-build.log
export DEBIAN_FRONTEND=noninteractive
# The caller's PATH may put pyenv/other pythons first; everything here uses Debian's tools.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# Unexpected failures (not through die) name the line and command; die() prints its own message.
trap 'ERR_AT="line $LINENO: $BASH_COMMAND"' ERR
trap 'rc=$?; [ $rc -eq 0 ] || [ -n "${SLURMCKPT_DIED:-}" ] || printf "[slurmckpt-setup] FAILED (exit %s) at %s\n" "$rc" "${ERR_AT:-?}" >&2' EXIT

step_start() { STEP_T0=$(date +%s%N); log "== $1"; }
step_done()  { local ms=$(( ($(date +%s%N) - STEP_T0) / 1000000 )); log "   done in $((ms / 1000)).$(( (ms % 1000) / 100 )) s"; }

# --------------------------------------------------------------------------------------------------- packages
# shellcheck source=scripts/packages.sh
. "$REPO/scripts/packages.sh"
PACKAGE_GROUPS=${SLURMCKPT_PACKAGES:-node criu-build test storage ops}

step_packages() {
  step_start "apt packages ($PACKAGE_GROUPS)"
  # shellcheck disable=SC2086
  install_packages $PACKAGE_GROUPS
  step_done
}

# ------------------------------------------------------------------------------------------------------- criu
criu_version() { "$1" --version 2>/dev/null | awk '/^Version:/ {print $2; exit}'; }

# criu_ok BIN: BIN exists, is >= CRIU_MIN and passes `criu check`.
criu_ok() {
  local bin=$1 v
  [ -x "$bin" ] || return 1
  v=$(criu_version "$bin")
  [ -n "$v" ] || { warn "$bin --version printed no version"; return 1; }
  if ! dpkg --compare-versions "$v" ge "$CRIU_MIN"; then log "   $bin is CRIU $v (< $CRIU_MIN)"; return 1; fi
  if ! "$bin" check >"$CRIU_CHECK_LOG" 2>&1; then
    warn "$bin (CRIU $v) fails 'criu check':"; tail -n 5 "$CRIU_CHECK_LOG" >&2
    return 1
  fi
  return 0
}

criu_ready() {
  local bin=$1
  CRIU_BIN=$bin
  echo "$bin" >"$CRIU_READY_FILE"
  log "   CRIU ready: $bin ($("$bin" --version | tr '\n' ' ')); 'criu check': $(tail -n1 "$CRIU_CHECK_LOG")"
}

criu_install_cached() {
  local dir=$1
  install -D -m 0755 "$dir/criu" /usr/local/sbin/criu
}

criu_build() {
  local src=$SLURMCKPT_CACHE/src list=/etc/apt/sources.list.d/slurmckpt-criu-src.sources tarball ver dir t0
  mkdir -p "$src"
  log "   fetching Debian's CRIU source tarball (deb-src trixie + sid)"
  cat >"$list" <<'EOF'
# Added by slurmckpt scripts/setup.sh only while fetching CRIU's source tarball; removed right after.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # trixie/sid Release files carry a Valid-Until date; a mirror snapshot older than that (or a skewed clock)
  # would make the whole update fail. The tarball is still checked against the signed .dsc's SHA256 below.
  local aptopt=(-o Acquire::Check-Valid-Until=false -o Acquire::Check-Date=false)
  if ! apt-get "${aptopt[@]}" update >"$src/apt-update.log" 2>&1; then
    rm -f "$list"; cat "$src/apt-update.log" >&2; die "apt-get update with the deb-src entry failed"
  fi
  # The .debian.tar.xz may 404 on the mirror; the .orig tarball is all we need, so apt's exit code is ignored.
  (cd "$src" && apt-get "${aptopt[@]}" source --download-only criu >"$src/apt-source.log" 2>&1) || true
  rm -f "$list"
  apt-get update >/dev/null 2>&1 || true   # drop the Sources lists again
  tarball=$(ls -1 "$src"/criu_*.orig.tar.* 2>/dev/null | sort -V | tail -n1 || true)
  [ -n "$tarball" ] || { cat "$src/apt-source.log" >&2; die "apt-get source --download-only criu fetched no orig tarball"; }
  ver=$(basename "$tarball" | sed -E 's/^criu_([^.]+\.[^.]+(\.[0-9]+)?)\.orig\.tar\..*/\1/')
  dpkg --compare-versions "$ver" ge "$CRIU_MIN" || die "Debian's newest CRIU source is $ver (< $CRIU_MIN)"
  # Verify the tarball against the .dsc's SHA256 when the .dsc came along.
  local dsc; dsc=$(ls -1 "$src"/criu_"$ver"-*.dsc 2>/dev/null | sort -V | tail -n1 || true)
  if [ -n "$dsc" ]; then
    local want; want=$(awk -v f="$(basename "$tarball")" '/^Checksums-Sha256:/ {s=1; next} /^[^ ]/ {s=0} s && $3==f {print $1}' "$dsc")
    [ -z "$want" ] || [ "$(sha256sum "$tarball" | cut -d' ' -f1)" = "$want" ] || die "checksum mismatch for $tarball"
  fi
  dir=$SLURMCKPT_CACHE/criu-$ver-p$(criu_patch_id)
  if [ -x "$dir/criu" ]; then log "   cache already holds CRIU $ver"; criu_install_cached "$dir"; return; fi
  log "   building CRIU $ver from $(basename "$tarball") (make -j$(nproc) criu; ~40 s on 2 cores)"
  rm -rf "$src/criu-$ver"
  tar -C "$src" -xf "$tarball"
  local p
  for p in "$REPO"/scripts/criu-patches/*.patch; do
    log "   applying $(basename "$p")"
    patch -d "$src/criu-$ver" -p1 --forward <"$p" >/dev/null || die "patch $p does not apply to CRIU $ver"
  done
  t0=$(date +%s)
  if ! make -C "$src/criu-$ver" -j"$(nproc)" criu >"$src/build-$ver.log" 2>&1; then
    tail -n 40 "$src/build-$ver.log" >&2; die "CRIU $ver build failed (full log: $src/build-$ver.log)"
  fi
  log "   CRIU $ver built in $(( $(date +%s) - t0 )) s"
  mkdir -p "$dir"
  install -m 0755 "$src/criu-$ver/criu/criu" "$dir/criu"
  echo "$ver" >"$dir/VERSION"
  rm -rf "$src/criu-$ver"
  criu_install_cached "$dir"
}

# Our CRIU carries scripts/criu-patches/ (rlimits read from /proc/<pid>/limits when prlimit() is refused to
# root without CAP_SYS_RESOURCE, as on these machines): the distribution's criu is never used, and a build is
# cached per CRIU version and patch set (criu_patch_id, scripts/lib.sh).

step_criu() {
  step_start "CRIU >= $CRIU_MIN (patched)"
  rm -f "$CRIU_READY_FILE"
  local d id; id=$(criu_patch_id)
  # 1. A cached build of this patch set (newest CRIU first), installed if needed.
  for d in $(ls -1d "$SLURMCKPT_CACHE"/criu-*-p"$id"/ 2>/dev/null | sort -V -r); do
    if criu_ok "$d/criu"; then
      cmp -s "$d/criu" /usr/local/sbin/criu || { log "   using cached build $d"; criu_install_cached "$d"; }
      criu_ok /usr/local/sbin/criu && { criu_ready /usr/local/sbin/criu; step_done; return; }
    fi
  done
  # 2. Build from Debian's source tarball with our patches.
  criu_build
  criu_ok /usr/local/sbin/criu || die "the CRIU built from source does not pass 'criu check' (see above)"
  criu_ready /usr/local/sbin/criu
  step_done
}

step_criu_build() {
  step_start "CRIU >= $CRIU_MIN (patched): build into $SLURMCKPT_CACHE, unchecked"
  local d; d=$(ls -1d "$SLURMCKPT_CACHE"/criu-*-p"$(criu_patch_id)"/ 2>/dev/null | sort -V | tail -n1 || true)
  if [ -n "$d" ] && [ -x "$d/criu" ]; then log "   cache already holds $d"; else criu_build; fi
  step_done
}

# ----------------------------------------------------------------------------------------------------- python
# py_tree_installed SRC SITE: every .py file under SRC has an identical copy under SITE.
py_tree_installed() {
  local src=$1 site=$2 f rc=0
  while IFS= read -r -d '' f; do
    cmp -s "$src/$f" "$site/$f" || { echo "   differs: $f" >&2; rc=1; }
  done < <(cd "$src" && find . -name __pycache__ -prune -o -type f -name '*.py' -print0)
  return $rc
}

step_python() {
  step_start "Python venv $SLURMCKPT_VENV"
  local py=/usr/bin/python3 want have
  want=$($py -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  have=$("$SLURMCKPT_VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
  if [ "$have" != "$want" ] || ! grep -q '^home = /usr/bin$' "$SLURMCKPT_VENV/pyvenv.cfg" 2>/dev/null; then
    log "   creating venv from $py ($want)"
    rm -rf "$SLURMCKPT_VENV"
    mkdir -p "$SLURMCKPT_PREFIX"
    $py -m venv "$SLURMCKPT_VENV" || die "python3 -m venv failed (is python3-venv installed?)"
  fi
  local pip=("$SLURMCKPT_VENV/bin/python" -m pip --disable-pip-version-check --no-input)
  # the test tools (pyproject.toml's [test] extra): pytest, prometheus-client's text-format parser, mypy
  # (make lint; pinned as in pyproject.toml) and pyflakes (make unit)
  "$SLURMCKPT_VENV/bin/python" -c 'import pytest, prometheus_client, pyflakes, importlib.metadata as m; assert m.version("mypy") == "2.4.0"' 2>/dev/null \
    || "${pip[@]}" install -q pytest prometheus-client "mypy==2.4.0" "pyflakes>=3" 2> >(grep -v "is ignored" >&2) \
    || die "pip install pytest prometheus-client mypy pyflakes failed"
  if [ -f "$REPO/pyproject.toml" ]; then
    # Non-editable: the installed copy is what Slurm runs. pip re-installs a local directory on every run;
    # if the installed sources still differ from the tree, force it. [gpu]: pynvml (pure Python; loads
    # libnvidia-ml.so.1 only when a GPU is used), so the unit tests check our fake NVML against the real one.
    "${pip[@]}" install -q "$REPO[gpu]" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
      || die "pip install $REPO failed"
    local site; site=$("$SLURMCKPT_VENV/bin/python" -c 'import slurmckpt, os; print(os.path.dirname(slurmckpt.__file__))')
    if ! py_tree_installed "$REPO/src/slurmckpt" "$site"; then
      log "   installed package differs from the tree: forcing a re-install"
      "${pip[@]}" install -q --no-deps --force-reinstall "$REPO" || die "pip re-install of $REPO failed"
      py_tree_installed "$REPO/src/slurmckpt" "$site" || die "installed package still differs from $REPO/src/slurmckpt (see above)"
    fi
  elif [ "$ALLOW_MISSING" = 1 ]; then
    warn "$REPO/pyproject.toml missing: the slurmckpt package is NOT installed (SLURMCKPT_DEV_ALLOW_MISSING=1)"
  else
    die "$REPO/pyproject.toml missing: cannot install the slurmckpt package"
  fi
  chmod -R a+rX "$SLURMCKPT_PREFIX"
  ln -sfn "$SLURMCKPT_VENV/bin/slurmckpt" /usr/local/bin/slurmckpt
  if [ -f "$REPO/pyproject.toml" ]; then
    local b; for b in slurmckpt slurmckpt-wrap; do
      [ -x "$SLURMCKPT_VENV/bin/$b" ] || die "$SLURMCKPT_VENV/bin/$b missing after pip install (pyproject.toml [project.scripts])"
    done
    # the srun an MPI launcher in a batch step finds first (config srun_standin_dir; docs/mpi.md)
    "$SLURMCKPT_VENV/bin/python" -c 'import sys; from slurmckpt.task.srun_standin import install; install(*sys.argv[1:])' \
      "$SLURMCKPT_VENV/libexec/slurmckpt/standin" "$SLURMCKPT_VENV/bin/python" >/dev/null \
      || die "could not write the srun stand-in"
  fi
  step_done
}

# ------------------------------------------------------------------------------------------------------ spank
SPANK_SO=/usr/local/lib/slurmckpt/slurmckpt_spank.so
SPANK_INIT=/usr/local/libexec/slurmckpt/slurmckpt-init

step_spank() {
  step_start "SPANK plugin + slurmckpt-init"
  if [ -f "$REPO/spank/Makefile" ]; then
    make -C "$REPO/spank" >"$SPANK_BUILD_LOG" 2>&1 \
      || { tail -n 40 "$SPANK_BUILD_LOG" >&2; die "make -C spank failed"; }
    make -C "$REPO/spank" install DESTDIR= >>"$SPANK_BUILD_LOG" 2>&1 \
      || { tail -n 40 "$SPANK_BUILD_LOG" >&2; die "make -C spank install failed"; }
    [ -f "$SPANK_SO" ] || die "make -C spank install did not install $SPANK_SO"
    [ -x "$SPANK_INIT" ] || die "make -C spank install did not install $SPANK_INIT"
  elif [ "$ALLOW_MISSING" = 1 ]; then
    warn "$REPO/spank/Makefile missing: SPANK plugin NOT built (SLURMCKPT_DEV_ALLOW_MISSING=1)"
  else
    die "$REPO/spank/Makefile missing: cannot build the SPANK plugin"
  fi
  step_done
}

# ------------------------------------------------------------------------------------------------------ users
step_users() {
  step_start "test users"
  local u
  # /var/tmp is world-writable: a directory another user made there (or a symlink) is refused, not reused
  local work=/var/tmp/slurmckpt-work
  if [ -L "$work" ] || { [ -e "$work" ] && [ "$(stat -c %u "$work")" != 0 ]; }; then
    die "$work exists and is not a root-owned directory (remove it and re-run)"
  fi
  install -d -o root -g root -m 0755 "$work"
  for u in ckptuser1 ckptuser2; do
    if ! id -u "$u" >/dev/null 2>&1; then
      useradd --create-home --shell /bin/bash --comment "slurmckpt test user" "$u" || die "useradd $u failed"
      passwd -l "$u" >/dev/null   # no password login
    fi
    install -d -o "$u" -g "$(id -gn "$u")" -m 0755 "$work/$u"
  done
  step_done
}

# ------------------------------------------------------------------------------------------------------ files
step_files() {
  step_start "slurmckpt config and directories"
  install -d -m 0755 /etc/slurmckpt
  if [ "${SLURMCKPT_KEEP_CONFIG:-0}" = 1 ] && [ -e /etc/slurmckpt/slurmckpt.yaml ]; then
    log "   /etc/slurmckpt/slurmckpt.yaml kept (make install never replaces a site's config)"
  elif [ -f "$REPO/etc/slurmckpt.yaml" ]; then
    install -m 0644 "$REPO/etc/slurmckpt.yaml" /etc/slurmckpt/slurmckpt.yaml
  else
    warn "$REPO/etc/slurmckpt.yaml missing: /etc/slurmckpt/slurmckpt.yaml not installed (package defaults apply)"
  fi
  install -d -m 0755 /var/lib/slurmckpt /var/lib/slurmckpt/summaries
  release_dead_mount /var/lib/slurmckpt/images
  install -d -o root -g root -m 0700 /var/lib/slurmckpt/images /var/log/slurmckpt
  step_done
}

# ------------------------------------------------------------------------------------------------ gc-schedule
# The job epilog removes a finished job's images; `slurmckpt gc` is the safety net (scripts/gc-schedule.sh).
step_gc_schedule() {
  step_start "slurmckpt gc schedule (systemd timer where systemd runs, else /etc/cron.d)"
  local f
  for f in $(bash "$REPO/scripts/gc-schedule.sh" auto "$SLURMCKPT_VENV/bin/slurmckpt"); do log "   $f"; done
  step_done
}

# ------------------------------------------------------------------------------------------------ slurm config
# render TEMPLATE DEST MODE: replace every @KEY@ with the value of shell variable T_KEY (multi-line values OK).
render() {
  local tpl=$1 dest=$2 mode=$3 text key var val tmp
  [ -f "$tpl" ] || die "template $tpl missing"
  text=$(<"$tpl")
  for key in $(grep -o '@[A-Z_][A-Z0-9_]*@' "$tpl" | sort -u | tr -d @); do
    var=T_$key
    declare -p "$var" >/dev/null 2>&1 || die "$tpl uses @$key@ but setup.sh does not define it"
    val=${!var}
    text=${text//@$key@/$val}
  done
  tmp=$(mktemp "$dest.XXXXXX")
  printf '%s\n' "$text" >"$tmp"
  chmod "$mode" "$tmp"
  mv -f "$tmp" "$dest"
}

step_slurm_config() {
  step_start "Slurm config in $SLURM_ETC (NODES=$NODES)"
  local d
  for d in state spool log dev; do install -d -m 0755 "$CLUSTER_DIR/$d"; done
  # Fake GPUs: character devices with NVIDIA's numbers (c 195 N; no driver: opening them fails). gres/gpu
  # needs File= entries, and ConstrainDevices denies the unallocated ones: with /dev/null's numbers that
  # would deny /dev/null to every job.
  for d in 0 1; do
    if [ "$(stat -c '%t:%T' "$CLUSTER_DIR/dev/nvidia$d" 2>/dev/null)" != "c3:$d" ]; then
      rm -f "$CLUSTER_DIR/dev/nvidia$d"; mknod -m 0666 "$CLUSTER_DIR/dev/nvidia$d" c 195 "$d"
    fi
  done

  # Hardware of this machine, as slurmd sees it.
  local hw cpus boards sockets cores threads realmem i
  hw=$(slurmd -C 2>/dev/null | head -n1) || true
  cpus=$(nproc)
  boards=$(sed -nE 's/.*Boards=([0-9]+).*/\1/p' <<<"$hw"); sockets=$(sed -nE 's/.*SocketsPerBoard=([0-9]+).*/\1/p' <<<"$hw")
  cores=$(sed -nE 's/.*CoresPerSocket=([0-9]+).*/\1/p' <<<"$hw"); threads=$(sed -nE 's/.*ThreadsPerCore=([0-9]+).*/\1/p' <<<"$hw")
  if [ -z "$boards" ] || [ -z "$sockets" ] || [ -z "$cores" ] || [ -z "$threads" ] \
     || [ $((boards * sockets * cores * threads)) -ne "$cpus" ]; then
    boards=1 sockets=1 cores=$cpus threads=1
  fi
  # RealMemory: 90% of MemTotal rounded down to whole GiB, split between the nodes in multi-node mode. Not
  # MemAvailable: that moves with the load, and the config (and the restart) should not. Memory is a
  # consumable resource (CR_Core_Memory): split between the nodes, it must stay below what slurmd detects.
  local mem_total
  mem_total=$(awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo)
  realmem=$(( mem_total * 9 / 10 / NODES / 1024 * 1024 ))
  [ "$realmem" -ge 1024 ] || realmem=$(( mem_total / NODES / 2 ))

  local host; host=$(hostname -s)
  T_CLUSTER_NAME=slurmckpt
  T_CLUSTER_DIR=$CLUSTER_DIR
  T_RUN_DIR=/run/slurmckpt
  T_SLURM_ETC=$SLURM_ETC
  T_SLURM_PLUGIN_DIR=$(dirname "$(ls /usr/lib/*/slurm-wlm/proctrack_pgid.so | head -n1)")
  T_CTLD_HOST=$host
  T_NODE_LINES="" T_GRES_LINES=""
  local nodelist
  if [ "$NODES" -eq 1 ]; then
    T_CTLD_ADDR=127.0.0.1
    nodelist=node1
    T_NODE_LINES="NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus Boards=$boards SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$realmem Gres=gpu:2 State=UNKNOWN"
  else
    T_CTLD_ADDR=$NET_HOST_IP
    nodelist="node[1-$NODES]"
    for i in $(seq 1 "$NODES"); do
      T_NODE_LINES+="NodeName=node$i NodeHostname=node$i NodeAddr=$NET_PREFIX.$i CPUs=$cpus Boards=$boards SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$realmem Gres=gpu:2 State=UNKNOWN"$'\n'
    done
    T_NODE_LINES=${T_NODE_LINES%$'\n'}
  fi
  T_NODE_LIST=$nodelist
  # What only newer releases know (one template serves 22.05 to 26.05): since 25.11 a requeued job waits
  # requeue_delay (1 s: the requeues of the tests), and jobs may ask for an expedited requeue.
  local version; version=$(slurmctld -V 2>/dev/null | awk '{print $2}')
  T_REQUEUE_DELAY="" T_RELEASE_LINES=""
  if dpkg --compare-versions "${version:-0}" ge 25.11; then
    T_REQUEUE_DELAY=",requeue_delay=1"
    T_RELEASE_LINES="SlurmctldParameters=enable_expedited_requeue"
  fi
  T_GRES_LINES="NodeName=$nodelist Name=gpu File=$CLUSTER_DIR/dev/nvidia[0-1]"

  # SPANK plugin line (docs/contracts.md); commented out only in the developer escape-hatch mode.
  T_SPANK_PREFIX=""
  if [ ! -f "$SPANK_SO" ]; then
    [ "$ALLOW_MISSING" = 1 ] || die "$SPANK_SO missing (run the spank step first)"
    warn "$SPANK_SO missing: plugstack.conf line commented out (SLURMCKPT_DEV_ALLOW_MISSING=1)"
    T_SPANK_PREFIX="# (not installed) "
  fi

  # slurmdbd's MariaDB password: generated once, kept root-only.
  install -d -m 0700 "$CLUSTER_DIR/secret"
  [ -s "$CLUSTER_DIR/secret/dbpass" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$CLUSTER_DIR/secret/dbpass")
  T_DB_PASS=$(<"$CLUSTER_DIR/secret/dbpass")
  T_DB_NAME=slurm_acct_db
  T_DB_USER=slurm

  install -d -m 0755 "$SLURM_ETC"
  render "$REPO/etc/slurm.conf.in"      "$SLURM_ETC/slurm.conf"      0644
  render "$REPO/etc/gres.conf.in"       "$SLURM_ETC/gres.conf"       0644
  render "$REPO/etc/cgroup.conf.in"     "$SLURM_ETC/cgroup.conf"     0644
  render "$REPO/etc/plugstack.conf.in"  "$SLURM_ETC/plugstack.conf"  0644
  install -m 0644 "$REPO/etc/cli_filter.lua" "$SLURM_ETC/cli_filter.lua"
  render "$REPO/etc/slurmdbd.conf.in"   "$SLURM_ETC/slurmdbd.conf"   0600
  echo "$NODES" >"$CLUSTER_DIR/nodes"
  log "   nodes: $nodelist, CPUs=$cpus each, RealMemory=$realmem MB, controller $host ($T_CTLD_ADDR)"
  step_done
}

# ---------------------------------------------------------------------------------------------------- cluster
step_cluster() {
  step_start "cluster (re)start"
  "$REPO/scripts/cluster.sh" restart || die "cluster start failed (see above)"
  step_done
}

# --------------------------------------------------------------------------------------------------- torch
# The programs the integration tests run as users do: PyTorch (CPU build) for torch.distributed jobs, in a
# venv of its own that every user can run (`make test` only; set-up for a real cluster never needs it).
TEST_VENV=/opt/slurmckpt/test-venv
TORCH_VERSION=2.13.0
step_torch() {
  step_start "PyTorch $TORCH_VERSION (CPU) for the tests in $TEST_VENV"
  if "$TEST_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    log "   already there"; step_done; return
  fi
  rm -rf "$TEST_VENV"
  /usr/bin/python3 -m venv "$TEST_VENV" || die "python3 -m venv $TEST_VENV failed"
  # pip's own configuration may name a local wheel directory holding the CPU build (much smaller than the
  # CUDA build PyPI gives for plain torch==X); either works for the tests.
  "$TEST_VENV/bin/python" -m pip --disable-pip-version-check --no-input install -q "torch==$TORCH_VERSION" numpy \
    2> >(grep -v "is ignored" >&2) || die "pip install torch==$TORCH_VERSION into $TEST_VENV failed"
  chmod -R a+rX "$TEST_VENV"
  step_done
}

# ------------------------------------------------------------------------------------------------------ smoke
step_smoke() {
  step_start "smoke check"
  local out rc=0 jid
  out=$(cd /var/tmp/slurmckpt-work/ckptuser1 && timeout 120 runuser -u ckptuser1 -- srun -N1 -J slurmckpt-smoke bash -c 'echo "ok $SLURM_JOB_ID"' 2>&1) || rc=$?
  if [ $rc -ne 0 ] || ! grep -q '^ok [0-9]' <<<"$out"; then
    echo "$out" >&2
    "$REPO/scripts/cluster.sh" logs >&2 || true
    die "smoke job 'runuser -u ckptuser1 -- srun -N1 ...' failed (rc=$rc)"
  fi
  jid=$(awk '/^ok [0-9]/ {print $2; exit}' <<<"$out")
  log "   srun as ckptuser1: job $jid ran"
  local i
  for i in $(seq 1 30); do
    # The record is complete once slurmctld has sent the job's end to slurmdbd (user and state filled in).
    if sacct -n -X -P -j "$jid" -o JobID,User,State,ExitCode 2>/dev/null | grep -qx "$jid|ckptuser1|COMPLETED|0:0"; then
      log "   sacct: $(sacct -n -X -P -j "$jid" -o JobID,User,State,ExitCode)"
      step_done; return
    fi
    sleep 1
  done
  sacct -n -X -j "$jid" >&2 || true
  tail_log "$CLUSTER_DIR/log/slurmdbd.log"
  die "sacct does not show job $jid of ckptuser1 as COMPLETED 0:0 after 30 s (accounting via slurmdbd broken?)"
}

# ------------------------------------------------------------------------------------------------------- main
main() {
  need_root
  install -d -o root -g root -m 0755 /var/lib/slurmckpt
  install -d -o root -g root -m 0700 "$SETUP_STATE"
  local steps=("$@") s t0
  [ ${#steps[@]} -gt 0 ] || steps=(packages criu python spank users files slurm-config cluster smoke)
  t0=$(date +%s)
  log "slurmckpt setup in $REPO (NODES=$NODES): ${steps[*]}"
  for s in "${steps[@]}"; do
    case $s in
      packages) step_packages ;; criu) step_criu ;; criu-build) step_criu_build ;; python) step_python ;; spank) step_spank ;;
      users) step_users ;; files) step_files ;; slurm-config) step_slurm_config ;;
      cluster) step_cluster ;; smoke) step_smoke ;; torch) step_torch ;; gc-schedule) step_gc_schedule ;;
      *) die "unknown step '$s'" ;;
    esac
  done
  log "setup finished in $(( $(date +%s) - t0 )) s"
}

main "$@"
