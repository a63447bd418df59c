#!/usr/bin/env bash
# Builds each named branch (or commit) into build-<name>/ beside this checkout, through a
# throwaway git worktree, so that their binaries can travel to one GPU call together (carry
# build-<name>/meshtrain and build-<name>/tests) and be compared there, e.g. with
# bench/ab_one_gpu.sh. "+" joins branches into one build: a+b builds a with b merged in.
# Usage: bench/build_branches.sh main gemm-residual logit-chunks gemm-residual+logit-chunks
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
for spec in "$@"; do
  name=${spec//\//-}; name=${name//+/-}
  wt=$(mktemp -d /tmp/wt-XXXXXX)
  IFS='+' read -r -a parts <<<"$spec"
  git worktree add -q --detach "$wt" "${parts[0]}"
  for extra in "${parts[@]:1}"; do
    git -C "$wt" -c user.name=build -c user.email=build@localhost merge -q --no-edit "$extra" >/dev/null
  done
  ln -s "$root/data" "$wt/data" 2>/dev/null || true
  echo "== $spec -> build-$name ($(git -C "$wt" rev-parse --short HEAD))"
  make -C "$wt" -j"$(nproc)" BUILD="$root/build-$name" meshtrain cuda >/dev/null
  git worktree remove --force "$wt"
done
