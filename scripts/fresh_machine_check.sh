#!/usr/bin/env bash
# The README's two commands on a bare Debian: a clean bookworm root made by debootstrap, with
# nothing in it but what the README asks for (Python 3), a fresh clone of this repository, then
#   bash scripts/install.sh --system && bash scripts/serve.sh serve_config.yaml
# in a chroot, until /healthz answers 200. Prints how long each part took and a JSON line.
# Needs root, debootstrap (installed if missing) and nothing else listening on port 8000.
#   sudo bash scripts/fresh_machine_check.sh [ROOT_DIR]   (default /tmp/gapless-fresh-root; reused)
# The chroot reaches the package registries the way this machine does: its DNS, the extra CA
# certificates it trusts (an egress proxy's), and pip's configuration and local wheel folders
# where the machine has them (read-only bind mounts).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${1:-/tmp/gapless-fresh-root}
[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, chroot, mounts)" >&2; exit 1; }
command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
now() { date +%s; }
t0=$(now)
[ -x "$root/usr/bin/apt-get" ] || debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
t_debootstrap=$(( $(now) - t0 ))

mounted=()
bind() {  # bind "$1" read-only (or "rw") at the same path inside the root
  mkdir -p "$root$1"; mount --bind "$1" "$root$1"; mounted+=("$root$1")
  [ "${2:-ro}" = ro ] && mount -o remount,bind,ro "$root$1" || true
}
cleanup() {
  chroot "$root" bash -c 'cd /home/gapless 2>/dev/null && .venv/bin/ray stop --force' >/dev/null 2>&1 || true
  for ((i=${#mounted[@]}-1; i>=0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind /proc rw; bind /sys rw; bind /dev rw; bind /dev/pts rw; bind /dev/shm rw
cp /etc/resolv.conf "$root/etc/resolv.conf"
for p in /etc/pip.conf /etc/xdg/pip /opt/wheels /opt/pypi /opt/pypi-more; do
  [ -e "$p" ] || continue
  if [ -d "$p" ]; then bind "$p"; else mkdir -p "$root$(dirname "$p")"; cp "$p" "$root$p"; fi
done
env_pip=$(env | grep -E '^PIP_' | tr '\n' ' ' || true)

# What the README assumes of a fresh machine: Python 3 (and git, to have the code).
t1=$(now)
chroot "$root" bash -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 git ca-certificates >/dev/null'
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
rm -rf "$root/home/gapless"
git clone -q "$repo" "$root/home/gapless"
t_base=$(( $(now) - t1 ))

t2=$(now)
chroot "$root" env $env_pip bash -c 'cd /home/gapless && bash scripts/install.sh --system' > "$root/install.log" 2>&1 \
  || { tail -30 "$root/install.log"; echo "install.sh failed (full log: $root/install.log)" >&2; exit 1; }
t_install=$(( $(now) - t2 ))
grep -E "^torch |^installed:" "$root/install.log" || true

t3=$(now)
chroot "$root" bash -c 'cd /home/gapless && exec bash scripts/serve.sh serve_config.yaml' > "$root/serve.log" 2>&1 &
status=""
for _ in $(seq 900); do
  status=$(python3 -c 'import urllib.request as u
try: print(u.urlopen("http://127.0.0.1:8000/healthz", timeout=5).status)
except Exception as e: print(getattr(e, "code", "down"))' 2>/dev/null)
  [ "$status" = 200 ] && break
  sleep 1
done
t_serve=$(( $(now) - t3 ))
[ "$status" = 200 ] || { tail -30 "$root/serve.log"; echo "not healthy after ${t_serve} s" >&2; exit 1; }
printf '%-28s %6s\n' "step" "s" "debootstrap (bookworm)" "$t_debootstrap" "python3 + git + clone" "$t_base" \
  "install.sh --system" "$t_install" "serve.sh until /healthz 200" "$t_serve"
echo "{\"fresh_machine\": true, \"debootstrap_s\": $t_debootstrap, \"base_s\": $t_base, \"install_s\": $t_install, \"serve_healthy_s\": $t_serve}"
