#!/usr/bin/env bash
# Fills data/ with the public files meshtrain needs (run by `make data`; idempotent).
# Each file is copied from the local mirror when there is one (../shared/data relative to
# the repo root, or $MESHTRAIN_SHARED_DATA; set it to "" to force downloading), otherwise
# downloaded from its public address. Every fetched file is checked against the sha256
# below, then moved into place atomically. A file already present with the right size is
# left alone. $MESHTRAIN_DATA_DIR (default data) names the destination.
set -euo pipefail

here=$(pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

absolute() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$here/$1" ;; esac; }

if [ "${MESHTRAIN_SHARED_DATA+set}" = set ]; then
  shared=$MESHTRAIN_SHARED_DATA
  if [ -n "$shared" ]; then
    shared=$(absolute "$shared")
    if [ ! -d "$shared" ]; then
      echo "fetch-data: MESHTRAIN_SHARED_DATA=$MESHTRAIN_SHARED_DATA is not a directory" >&2
      exit 1
    fi
  fi
elif [ -d "$root/../shared/data" ]; then
  shared=$(cd "$root/../shared/data" && pwd)
else
  shared=""
fi
dest=$(absolute "${MESHTRAIN_DATA_DIR:-$root/data}")

HF=https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main
OPENAI=https://openaipublic.blob.core.windows.net/gpt-2/encodings/main
LLAMACPP=https://raw.githubusercontent.com/ggml-org/llama.cpp/master/models

# relative path | bytes | sha256 | how to download (plain URL | head-bytes N URL | head-lines N URL)
FILES=(
  "gpt2/encoder.json|1042301|196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783|plain $OPENAI/encoder.json"
  "gpt2/vocab.bpe|456318|1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5|plain $OPENAI/vocab.bpe"
  "test_vectors/llamacpp-ggml-vocab-gpt-2.gguf.inp|1944|ef7a25a263fba141f64a8a842ceb1c572cdb8e1313f592d974f7a06bbd3a4934|plain $LLAMACPP/ggml-vocab-gpt-2.gguf.inp"
  "test_vectors/llamacpp-ggml-vocab-gpt-2.gguf.out|2146|a2630e9cf29c0ddbd9fd79fe358dc83e80af779f886eeaa7627dbfdeec54bae6|plain $LLAMACPP/ggml-vocab-gpt-2.gguf.out"
  "tinystories/TinyStories-train.head-2MiB.txt|2097152|5352b299dcb1a32898b2d779b145b5a05f3e1265953fd21c264c9f9f9c9ae33d|head-bytes 2097152 $HF/TinyStories-train.txt"
  "tinystories/TinyStoriesV2-GPT4-train.head-10000lines.txt|1424708|5a19b936d7b53bbdac1eea03230b00161dceca24ae272f5bd8e9dbbc2a883418|head-lines 10000 $HF/TinyStoriesV2-GPT4-train.txt"
)

tmpfiles=()
cleanup() { [ ${#tmpfiles[@]} -eq 0 ] || rm -f "${tmpfiles[@]}"; }
trap cleanup EXIT

fail() { echo "fetch-data: $*" >&2; exit 1; }

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
  elif command -v shasum >/dev/null 2>&1; then shasum -a 256 "$1" | cut -d' ' -f1
  else fail "neither sha256sum nor shasum is installed"; fi
}

size_of() { wc -c <"$1" | tr -d ' '; }

CURL=(curl -fsSL --retry 3 --connect-timeout 30 --proto-redir "=https")

# fetch_url <out> <url> [curl options...]: one line naming the URL and curl's complaint on failure.
fetch_url() {
  local out=$1 url=$2 msg rc=0
  shift 2
  msg=$("${CURL[@]}" "$@" -o "$out" "$url" 2>&1) || rc=$?
  [ $rc -eq 0 ] || fail "cannot download $url: $(printf '%s' "$msg" | tail -n 1) (curl exit $rc)"
}

# download <kind> <arg...> <out>: writes the bytes of the file into <out>.
download() {
  local kind=$1 out=${*: -1}
  command -v curl >/dev/null 2>&1 || fail "curl is not installed (needed to download ${rel}); run make deps"
  case $kind in
    plain) fetch_url "$out" "$2" ;;
    head-bytes|head-lines)
      # A byte range keeps us from pulling the whole ~2 GB file; --max-filesize stops a
      # server that ignores the range. For lines, 4 MiB holds 10,000 TinyStories lines.
      local n=$2 url=$3 want part="$out.part"
      [ "$kind" = head-bytes ] && want=$n || want=4194304
      tmpfiles+=("$part")
      fetch_url "$part" "$url" -r "0-$((want - 1))" --max-filesize $((want * 2))
      if [ "$kind" = head-bytes ]; then
        [ "$(size_of "$part")" -ge "$n" ] || fail "$url: got $(size_of "$part") bytes, expected at least $n"
        head -c "$n" "$part" >"$out"
      else
        head -n "$n" "$part" >"$out"
        [ "$(wc -l <"$out" | tr -d ' ')" -eq "$n" ] || fail "$url: the first $want bytes hold fewer than $n lines"
      fi
      rm -f "$part" ;;
    *) fail "internal error: unknown download kind $kind" ;;
  esac
}

for entry in "${FILES[@]}"; do
  IFS='|' read -r rel bytes sum how <<<"$entry"
  dst=$dest/$rel
  if [ -f "$dst" ] && [ "$(size_of "$dst")" -eq "$bytes" ]; then continue; fi
  mkdir -p "$(dirname "$dst")" || fail "cannot create $(dirname "$dst")"
  tmp=$dst.tmp.$$
  tmpfiles+=("$tmp")
  if [ -n "$shared" ] && [ -f "$shared/$rel" ]; then
    cp "$shared/$rel" "$tmp" || fail "cannot copy $shared/$rel to $tmp"
    chmod u+w "$tmp"
    what="copied from $shared"
    from="$shared/$rel"
  else
    # shellcheck disable=SC2086  # $how is "kind arg... url", split on purpose
    download $how "$tmp"
    what="downloaded"
    from=${how##* }
  fi
  got=$(sha256_of "$tmp")
  [ "$got" = "$sum" ] || fail "$from: sha256 $got, expected $sum ($rel)"
  mv -f "$tmp" "$dst" || fail "cannot move $tmp to $dst"
  echo "${dst#"$root"/}: $what ($bytes bytes, sha256 ok)"
done
