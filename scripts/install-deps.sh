#!/usr/bin/env bash
# Installs the Debian packages meshtrain needs, only those missing (idempotent; when all are
# there it runs no apt at all).
#   scripts/install-deps.sh         building, training and the tests (make deps, make test, CI)
#   scripts/install-deps.sh build   building and training only (make train): no Slurm daemons
set -euo pipefail
case "${1:-all}" in all | build) ;; *) echo "install-deps.sh: usage: install-deps.sh [build]" >&2; exit 2 ;; esac
need=(gcc make libopenblas-dev libpcre2-dev libopenmpi-dev openmpi-bin ca-certificates curl
      python3 python3-numpy  # NumPy: tests/hf_llama_numpy.py and hf_moe_numpy.py, run with /usr/bin/python3
      iproute2)  # ip and tc: the emulated cluster (scripts/cluster.sh)
# Slurm and munge: tests/test_slurm.sh starts a one-node cluster (scripts/slurm-local.sh).
# About 6 MB, 20-30 s on a fresh machine; left out of `build`, so that training on a
# workstation does not install (and, under systemd, enable) Slurm's and munge's services.
[ "${1:-all}" = build ] || need+=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
