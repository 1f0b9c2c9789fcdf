#!/usr/bin/env bash
# Test the ends of every supported range: each package in turn at the lowest and the newest version
# its range admits, everything else at requirements/constraints.txt, in its own venv (.compat/).
#
#   scripts/compat_check.sh                     the whole matrix (torch, transformers, accelerate, lightning, trl)
#   scripts/compat_check.sh transformers        one package's two ends
#   scripts/compat_check.sh transformers=5.23.0 one cell
#   COMPAT_TESTS="tests/..." scripts/compat_check.sh   other tests than the integration + parallelism set
#
# Prints one line per cell and the matrix at the end; exits 1 if any cell failed. The ranges are
# read from setup.py (install_requires and the dev extra); "newest" is the newest release on the
# package index inside the range. torch cells install the CUDA build from the index where no CPU
# build lies on disk (it runs on CPU); the others use the torch of requirements (torch==2.13.0).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
# The cells test the committed tree (HEAD), exported once, so editing the working tree meanwhile
# cannot change what a cell runs.
SRC="$ROOT/.compat/src"
rm -rf "$SRC" && mkdir -p "$SRC" && git archive HEAD | tar -x -C "$SRC"
PYTHON="${PYTHON:-python3}"
META_PYTHON="${META_PYTHON:-.venv/bin/python}"  # reads the dependency closure of the installed packages
BASE_TORCH="${SLIPSTREAM_TORCH:-torch==2.13.0}"
TESTS="${COMPAT_TESTS:-tests/integration/test_host_examples.py tests/integration/test_hf_trainer_switch.py tests/integration/test_accelerate_switch.py tests/integration/test_lightning_switch.py tests/distributed/test_tensor_parallel.py tests/distributed/test_sequence_parallel.py tests/distributed/test_context_parallel.py tests/distributed/test_pipeline.py tests/distributed/test_expert_parallel.py tests/unit/test_activation_checkpointing.py}"
PACKAGES=(torch transformers accelerate lightning trl)
mkdir -p .compat
RESULTS=.compat/results.txt
: > "$RESULTS"

range_of() {  # the specifier setup.py gives a package (dev extra first, then install_requires)
  "$PYTHON" - "$1" <<'PY'
import re, sys
text = open("setup.py").read()
name = sys.argv[1]
found = re.findall(r'"%s((?:[<>=!~]=?[^",]+,?)+)"' % re.escape(name), text)
print(found[-1] if found else "")
PY
}

ends_of() {  # "lowest newest" for a package: the range's floor and the newest release inside it
  local pkg="$1" spec
  spec="$(range_of "$pkg")"
  "$PYTHON" - "$pkg" "$spec" <<'PY'
import re, subprocess, sys
from packaging.specifiers import SpecifierSet
from packaging.version import Version
pkg, spec = sys.argv[1], SpecifierSet(sys.argv[2])
out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", pkg], capture_output=True, text=True).stdout
listed = re.search(r"Available versions: (.*)", out)
versions = sorted({Version(v.strip()) for v in listed.group(1).split(",")} if listed else set())
final = [v for v in versions if not v.is_prerelease and not v.local and v in spec]
if not final:
    sys.exit(f"compat_check: no release of {pkg} in {spec}")
print(final[0], final[-1])
PY
}

run_cell() {  # package version
  local pkg="$1" version="$2" venv="$ROOT/.compat/$1-$2" log="$ROOT/.compat/$1-$2.log" constraints
  constraints="$(mktemp)"
  # The package and what it depends on float (an old release needs old dependencies); the rest stays pinned.
  "$META_PYTHON" - "$pkg" <<'PY' > "$constraints"
import re, sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
def closure(name, seen):
    name = canonicalize_name(name)
    if name in seen:
        return seen
    seen.add(name)
    try:
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return seen
    for text in requires:
        r = Requirement(text)
        if r.marker is None or "extra" not in str(r.marker):
            closure(r.name, seen)
    return seen
floating = closure(sys.argv[1], set()) | ({"pytorch-lightning"} if sys.argv[1] == "lightning" else set())
for line in open("requirements/constraints.txt"):
    name = line.split("==")[0].strip()
    if line.startswith("#") or canonicalize_name(name) not in floating:
        print(line.rstrip())
PY
  [ "$pkg" = lightning ] && echo "pytorch-lightning==$version" >> "$constraints"
  [ "$pkg" != torch ] && echo "${pkg}==${version}" >> "$constraints"
  local torch_spec="$BASE_TORCH"
  [ "$pkg" = torch ] && torch_spec="torch==$version"
  echo "== $pkg $version ($venv)"
  (
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$venv"
    # The machine-wide pip constraint may cap torch at what lies on its disk; a torch cell asks the index.
    if [ "$pkg" = torch ]; then
      PIP_CONSTRAINT="$constraints" "$venv/bin/python" -m pip install --quiet "$torch_spec"
    fi
    (cd "$SRC" && VENV="$venv" SLIPSTREAM_TORCH="$torch_spec" SLIPSTREAM_CONSTRAINTS="$constraints" PIP_CONSTRAINT="$constraints" ./scripts/setup.sh) || exit 1
    "$venv/bin/python" -c "import torch, transformers, accelerate, lightning; print('versions: torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'lightning', lightning.__version__)"
    (cd "$SRC" && "$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS)
  ) > "$log" 2>&1
  local code=$?
  local summary versions
  summary="$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$log" | tail -1 | tr -d '=' | sed 's/^ *//')"
  versions="$(grep '^versions:' "$log" | tail -1 | sed 's/^versions: //')"
  [ -z "$summary" ] && summary="set-up failed (see $log)"
  local verdict=pass
  [ "$code" = 0 ] || verdict=FAIL
  printf '%-12s %-10s %-4s %s | %s\n' "$pkg" "$version" "$verdict" "$summary" "$versions" | tee -a "$RESULTS"
  rm -f "$constraints"
  return "$code"
}

CELLS=()
if [ "$#" = 0 ]; then set -- "${PACKAGES[@]}"; fi
for arg in "$@"; do
  if [[ "$arg" == *=* ]]; then
    CELLS+=("${arg%%=*} ${arg#*=}")
  else
    read -r low high < <(ends_of "$arg") || { echo "compat_check: cannot find the ends of $arg" >&2; exit 2; }
    CELLS+=("$arg $low")
    [ "$high" != "$low" ] && CELLS+=("$arg $high")
  fi
done

failed=0
for cell in "${CELLS[@]}"; do
  run_cell $cell || failed=1
done
echo
echo "== compatibility matrix (tests: integration + parallelism; the other packages at requirements/constraints.txt)"
printf '%-12s %-10s %-4s %s\n' package version ok "result | versions in the venv"
cat "$RESULTS"
exit "$failed"
