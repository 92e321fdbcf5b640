# shellcheck shell=bash
# A Debian root of another suite on this machine, and a way to run commands in it with its own namespaces
# (sourced by scripts/fresh-root-test.sh and scripts/slurm-suite.sh; docs/slurm-versions.md).
#
#   root_tools                  debootstrap installed on the host (once, before roots are prepared side by side)
#   root_prepare SUITE ROOT     debootstrap --variant=minbase SUITE into ROOT unless it is there; apt sources,
#                               resolver, this machine's apt/pip/TLS settings copied in
#   root_copy_repo REPO ROOT    the work tree (no .git, no build outputs) to ROOT/root/repo
#   root_run ROOT NET SCRIPT    bash -c SCRIPT inside ROOT, as root, with its own mount, PID, UTS, IPC and cgroup
#                               namespaces; NET=yes adds its own network namespace (loopback plus a veth pair)
#   ROOT_HOSTNAME               the hostname inside (default cinode)
#
# Nothing started inside outlives root_run: unshare --kill-child takes the PID namespace down with it. The
# cgroup namespace's root is a fresh child of this shell's own cgroup in every hierarchy mounted under
# /sys/fs/cgroup (named after ROOT), and ROOT/sys/fs/cgroup shows that child as the top: Slurm's cgroups
# inside (slurm_<node>/uid_<uid>/job_<id>) never meet the host cluster's, whatever the job ids.
# Needs debootstrap (installed with apt-get when missing) and util-linux's unshare.

ROOT_HOSTNAME=${ROOT_HOSTNAME:-cinode}

# root_sources SUITE: the root's apt sources. A release has SUITE-updates and SUITE-security; sid (unstable)
# has neither, and apt-get update fails on their missing Release files.
root_sources() {
  local suite=$1 keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  case $suite in
    sid|unstable) printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
                    "$suite" "$keyring" ;;
    *) printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s %s-updates\nComponents: main\nSigned-By: %s\n\n' \
         "$suite" "$suite" "$keyring"
       printf 'Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: %s-security\nComponents: main\nSigned-By: %s\n' \
         "$suite" "$keyring" ;;
  esac
}

# root_tools: debootstrap on the host. Called by root_prepare, and once before roots are prepared side by side
# (scripts/test-suites.sh): two apt-get runs at once would fail on dpkg's lock.
root_tools() {
  if ! command -v debootstrap >/dev/null; then   # the host's package lists may be absent or old: update once
    apt-get install -y -q debootstrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; } \
      || { echo "debian-root: needs debootstrap (apt-get install -y debootstrap failed)" >&2; return 1; }
  fi
}

root_prepare() {
  local suite=$1 root=$2 dlog
  case $suite in *[!a-z0-9-]*|'') echo "debian-root: '$suite' is not a Debian suite name" >&2; return 1;; esac
  root_tools || return 1
  # The root is root's alone: a directory another user made (or a symlink) is refused, never written through.
  install -d -o root -g root -m 0755 "$(dirname "$root")"
  if [ -L "$root" ] || { [ -e "$root" ] && [ "$(stat -c %u "$root")" != 0 ]; }; then
    echo "debian-root: $root exists and is not a root-owned directory (remove it)" >&2; return 1
  fi
  if [ ! -x "$root/bin/bash" ]; then
    echo "== debootstrap $suite -> $root"
    rm -rf "$root"
    dlog=$(mktemp)
    debootstrap --variant=minbase "$suite" "$root" http://deb.debian.org/debian >"$dlog" 2>&1 \
      || { tail -20 "$dlog"; rm -f "$dlog"; return 1; }
    rm -f "$dlog" "$root/etc/apt/sources.list"
    root_sources "$suite" >"$root/etc/apt/sources.list.d/debian.sources"
    echo "127.0.0.1 localhost $ROOT_HOSTNAME" >"$root/etc/hosts"
  fi
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  # This machine's apt settings (its mirror snapshot is older than the suites' Valid-Until) ...
  local f
  for f in /etc/apt/apt.conf.d/99artifact-registry; do [ ! -f "$f" ] || cp "$f" "$root/etc/apt/apt.conf.d/"; done
  # ... and its TLS set-up for PyPI (CA bundle with the registry proxy's CA, pip.conf pointing at it).
  [ ! -f /etc/pip.conf ] || cp /etc/pip.conf "$root/etc/pip.conf"
  mkdir -p "$root/etc/ssl/certs" "$root/usr/local/share/ca-certificates"
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
}

root_copy_repo() {
  local repo=$1 root=$2
  rm -rf "$root/root/repo"; mkdir -p "$root/root/repo"
  tar -C "$repo" --exclude=.git --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ -cf - . \
    | tar -C "$root/root/repo" -xf -
  [ ! -f "$root/root/repo/spank/Makefile" ] || make -s -C "$root/root/repo/spank" clean >/dev/null
}

# root_cgroup_dirs NAME: for every cgroup hierarchy mounted under /sys/fs/cgroup, "MOUNTPOINT DIR" where DIR is
# NAME under this shell's own cgroup of that hierarchy.
root_cgroup_dirs() {
  awk -v name="$1" '
    function all_in(list, set,   c, m, j) {
      m = split(list, c, ","); for (j = 1; j <= m; j++) if (!(c[j] in set)) return 0; return 1
    }
    FNR == NR { split($0, f, ":"); own[f[2]] = substr($0, length(f[1]) + length(f[2]) + 3); next }
    {
      for (i = 7; $i != "-"; i++) ; fstype = $(i + 1); super = $(i + 3)
      if ($5 !~ "^/sys/fs/cgroup(/|$)" || (fstype != "cgroup" && fstype != "cgroup2")) next
      key = ""
      if (fstype == "cgroup") {          # the /proc/self/cgroup line whose controllers this mount has
        n = split(super, o, ","); delete has; for (l = 1; l <= n; l++) has[o[l]] = 1
        key = "-"
        for (k in own) if (k != "" && all_in(k, has)) key = k
        if (key == "-") next
      }
      path = own[key]
      if ($4 != "/") sub("^" $4, "", path)     # relative to the mount'"'"'s own root
      if (path == "/") path = ""
      print $5, $5 path "/" name
    }' /proc/self/cgroup /proc/self/mountinfo
}

# root_cgroup_remove NAME: NAME and whatever was made under it, in every hierarchy (empty once the PID namespace
# that used them is gone), deepest first.
root_cgroup_remove() {
  local mnt dir i left
  for ((i = 0; i < 50; i++)); do   # the namespace's last processes may still be exiting
    left=0
    while read -r mnt dir; do
      [ ! -d "$dir" ] || find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || left=1
    done < <(root_cgroup_dirs "$1")
    [ $left = 1 ] || return 0
    sleep 0.1
  done
  echo "debian-root: cgroups $1 not empty, left in place" >&2
}

# root_cgroup_enter NAME: make NAME (an earlier run's leftovers removed) in every hierarchy and move this shell
# into it.
root_cgroup_enter() {
  local name=$1 mnt dir d
  root_cgroup_remove "$name"
  while read -r mnt dir; do
    mkdir -p "$dir"
    if [ -f "$dir/cpuset.cpus" ] && [ -z "$(cat "$dir/cpuset.cpus")" ]; then   # v1 cpuset: empty until set
      d=$(dirname "$dir"); cat "$d/cpuset.cpus" >"$dir/cpuset.cpus"; cat "$d/cpuset.mems" >"$dir/cpuset.mems"
    fi
    echo "$BASHPID" >"$dir/cgroup.procs"
  done < <(root_cgroup_dirs "$name")
}

root_run() { # root_run ROOT NET(yes|no) SCRIPT
  local root=$1 net=$2 script=$3 rc=0 cg
  cg=slurmckpt-root-$(basename "$root")
  local flags=(--mount --pid --uts --ipc --cgroup --fork --kill-child)
  [ "$net" = no ] || flags+=(--net)
  # The cgroup-only mounts of this host, to be mounted again inside (fresh, so they show the namespace's root).
  local mounts; mounts=$(awk '{for (i = 7; $i != "-"; i++) ;
    if ($5 ~ "^/sys/fs/cgroup(/|$)" && ($(i+1) == "cgroup" || $(i+1) == "cgroup2")) print $5, $(i+1), $(i+3)}' \
    /proc/self/mountinfo)
  (
    root_cgroup_enter "$cg"
    exec unshare "${flags[@]}" bash -c '
      set -e; R=$1 MOUNTS=$4
      mount --make-rprivate /
      mount --bind "$R" "$R"   # the new root must be a mount point (pivot_root; CRIU checks the mount tree)
      mount -t proc proc "$R/proc"; mount --rbind /sys "$R/sys"; mount --rbind /dev "$R/dev"
      # v1/hybrid hosts: a tmpfs with one mount per hierarchy; unified hosts: cgroup2 on /sys/fs/cgroup itself
      [ -z "$MOUNTS" ] || grep -q "^/sys/fs/cgroup " <<<"$MOUNTS" \
        || mount -t tmpfs -o mode=755 cgroup "$R/sys/fs/cgroup"
      while read -r mnt fstype opts; do
        [ -n "$mnt" ] || continue
        mkdir -p "$R$mnt"; mount -t "$fstype" -o "$opts" cgroup "$R$mnt"
      done <<<"$MOUNTS"
      mount -t tmpfs tmpfs "$R/run"; mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm" 2>/dev/null || true
      hostname "$5"
      if [ -n "$3" ]; then
        # Own netns: loopback plus a veth pair with an address (glibc getaddrinfo(AI_ADDRCONFIG) fails with
        # loopback alone, and slurmdbd then cannot bind; this kernel has no dummy driver).
        ip link set lo up; ip link add ckptv0 type veth peer name ckptv1
        ip addr add 10.79.0.1/24 dev ckptv0; ip link set ckptv0 up; ip link set ckptv1 up
      fi
      mkdir -p "$R/.oldroot"; cd "$R"; pivot_root . .oldroot; umount -l /.oldroot
      exec /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin /bin/bash -c "$2"' \
      _ "$root" "$script" "$([ "$net" = no ] || echo 1)" "$mounts" "$ROOT_HOSTNAME"
  ) &
  # If the caller is stopped, unshare goes too, and --kill-child takes the whole PID namespace with it.
  # SIGKILL: unshare --fork ignores SIGINT and SIGTERM while it waits for its child.
  local pid=$!
  trap 'kill -KILL $pid 2>/dev/null' EXIT INT TERM
  wait $pid || rc=$?
  trap - EXIT INT TERM
  root_cgroup_remove "$cg"
  return $rc
}
