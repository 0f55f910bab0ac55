#!/usr/bin/env bash
# Compile every .cu under kernels/cuda/csrc for sm_90a, sm_100a and sm_103a (compile only; no GPU needed).
# Fails on compile errors, on any warning (nvcc warnings are errors, host warnings -Wall -Wextra -Werror), and on
# register spills reported by ptxas (-Xptxas -v). Prints registers / spills per kernel and arch.
# Builds with the macros torch's extension build adds (no implicit half / bf16 conversions or operators), so code
# that passes here also builds through kernels/cuda/build.py.
# Usage: kernels/cuda/compile_check.sh [jobs]   (env NVCC overrides the compiler, ARCHS the arch list)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nvcc="${NVCC:-nvcc}"
archs="${ARCHS:-90a 100a 103a}"
jobs="${1:-$(nproc)}"
command -v "$nvcc" >/dev/null || { echo "compile_check: $nvcc not found" >&2; exit 2; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mapfile -t sources < <(find "$here/csrc" -name '*.cu' | sort)
[ "${#sources[@]}" -gt 0 ] || { echo "compile_check: no .cu files" >&2; exit 2; }
for src in "${sources[@]}"; do
  for arch in $archs; do
    printf '%s\t%s\n' "$src" "$arch"
  done
done | xargs -P "$jobs" -L 1 bash -c '
  src="$0"; arch="$1"; log="'"$out"'/$(echo "$src" | tr / _)_$arch.log"
  if '"$nvcc"' -std=c++17 -O3 -gencode "arch=compute_${arch},code=sm_${arch}" -Xptxas -v -Werror all-warnings \
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
       -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -Xcompiler -Wall,-Wextra,-Werror -c "$src" -o /dev/null > "$log" 2>&1; then echo ok > "$log.status"; \
  else echo fail > "$log.status"; fi'
status=0
for src in "${sources[@]}"; do
  for arch in $archs; do
    log="$out/$(echo "$src" | tr / _)_$arch.log"
    rel="${src#"$here"/}"
    if [ "$(cat "$log.status")" != ok ]; then
      echo "FAIL  $rel  sm_$arch"; sed 's/^/    /' "$log"; status=1; continue
    fi
    # ptxas: "Compiling entry function '<mangled>' for 'sm_XX'" then "Used N registers" and spill lines.
    awk -v rel="$rel" -v arch="$arch" '
      /Compiling entry function/ { match($0, /\x27[^\x27]+\x27/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
      /bytes spill stores/ { split($0, a, " "); for (i = 1; i <= NF; i++) if ($i == "bytes" && $(i+1) == "spill" && $(i+2) == "stores,") ss = $(i-1); if ($0 ~ /[1-9][0-9]* bytes spill (stores|loads)/) spill = 1 }
      /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15);
        printf "ok    %s  sm_%s  %s  regs=%s spill=%s\n", rel, arch, fn, regs, (spill ? "YES" : "0"); if (spill) bad = 1; spill = 0 }
      END { exit bad }' "$log" || { echo "SPILL $rel sm_$arch"; status=1; }
  done
done
exit $status
