#!/usr/bin/env bash
# Installs the Debian packages meshtrain needs, only those missing (idempotent).
set -euo pipefail
need=(gcc make libopenblas-dev libpcre2-dev libopenmpi-dev openmpi-bin ca-certificates curl
      python3 python3-numpy  # NumPy: tests/hf_llama_numpy.py and hf_moe_numpy.py, run with /usr/bin/python3
      iproute2)  # ip and tc: the emulated cluster (scripts/cluster.sh)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
