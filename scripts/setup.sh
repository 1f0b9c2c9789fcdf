#!/usr/bin/env bash
# Set up a development environment in .venv: torch (only if none is importable), then slipstream
# editable with its test and monitoring extras. Safe to re-run; never replaces an existing torch.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_FALLBACK="${SLIPSTREAM_TORCH:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  # System site-packages stay visible so a torch the user already has (CPU, CUDA, ROCm) is reused.
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), "slipstream needs Python 3.10 or newer"'

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "setup: no torch found; installing $TORCH_FALLBACK" >&2
  "$PY" -m pip install --quiet --disable-pip-version-check "$TORCH_FALLBACK" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  "$PY" -c 'import torch' || { echo "setup: installing $TORCH_FALLBACK failed" >&2; exit 1; }
fi
# The installed distribution's version, not torch.__version__: a CUDA wheel from PyPI reports "2.15.0+cu132" while
# pip knows it as 2.15.0, and pinning the former would make every install impossible.
TORCH_VERSION="$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')"

# Pin whatever torch is present so resolving our dependencies can never swap it out, and every
# other dependency to the version the suite last passed with (requirements/constraints.txt), so a
# fresh clone reproduces CI. SLIPSTREAM_CONSTRAINTS names another file (scripts/compat_check.sh
# uses it to move one package to an end of its range); the package's own ranges stay open.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
grep -v -i '^torch==' "${SLIPSTREAM_CONSTRAINTS:-requirements/constraints.txt}" >> "$CONSTRAINTS"
# (pip's own status decides: the filter only hides a harmless notice of this machine's pip config)
"$PY" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS" -e ".[dev]" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
[ "${PIPESTATUS[0]}" = 0 ] || { echo "setup: installing slipstream's dependencies failed (see pip's message above)" >&2; exit 1; }
# Compile the ops now (CPU Adam, async I/O; cached per torch/compiler/flags), so no first run of a
# user waits for a compiler: an offload config's first loss would otherwise include the build.
"$PY" -m slipstream.ops.build >/dev/null 2>&1 \
  || echo "setup: some ops did not build; they fall back to PyTorch ('slipstream report' says why)" >&2
# The ssh runner's tests start a private sshd on 127.0.0.1; install the server where we can (root
# with apt-get). Elsewhere the tests install nothing and skip with the reason.
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server >/dev/null 2>&1 \
      || echo "setup: could not install openssh-server; the ssh launcher tests will be skipped" >&2
  else
    echo "setup: no sshd (and no root apt-get to install it); the ssh launcher tests will be skipped" >&2
  fi
fi
"$PY" -c 'import slipstream, torch; print(f"setup: slipstream {slipstream.__version__} with torch {torch.__version__} in '"$VENV"'")'
