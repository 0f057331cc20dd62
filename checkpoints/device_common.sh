# What the device scripts of this folder share; sourced from the repository root, after `set -uo pipefail`:
#   source checkpoints/device_common.sh WORK_DEFAULT LOG_NAME
# $OUT (the device's result folder, /tmp/out elsewhere), a fresh $WORK (WORK_DEFAULT unless set), everything printed
# also kept in $OUT/LOG_NAME, T0 and since (seconds since the start), and build_extension (the editable install for
# sm_90 in the foreground, its log in $OUT/build.log; SKIP_BUILD=1 skips it).
OUT=${OUT:-/tmp/out}
WORK=${WORK:-$1}
T0=$(date +%s)
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/$2") 2>&1
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} TOKENIZERS_PARALLELISM=false
since() { echo $(( $(date +%s) - T0 )); }
build_extension() {
  [ "${SKIP_BUILD:-0}" = 1 ] && return 0
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $(since) s"
}
