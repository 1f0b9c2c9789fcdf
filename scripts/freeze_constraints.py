"""Write requirements/constraints.txt: the exact versions of slipstream[dev]'s dependency closure in this environment.

    .venv/bin/python scripts/freeze_constraints.py          # after a green suite on the newest versions

[Note: why a constraints file] The package declares open ranges (a user's install resolves them);
the README's test command and CI install through ``scripts/setup.sh``, which passes this file to
pip as ``-c``, so a fresh clone gets the versions the suite last passed with, not whatever was
released since (transformers 5.24.0 broke two tests the day it came out). ``scripts/compat_check.sh``
tests both ends of each range. torch is not pinned here: setup.sh keeps the torch a machine already
has (CPU, CUDA, ROCm) and installs ``SLIPSTREAM_TORCH`` (torch==2.13.0) only where there is none.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
NOT_PINNED = {"torch", "slipstream"}
# torch's own dependencies come with whichever torch the machine has: pinning them could fight it.
TORCH_DEPENDENCIES = {
    canonicalize_name(r.name)
    for r in map(Requirement, metadata.requires("torch") or [])
    if r.marker is None or "extra" not in str(r.marker)
}


def closure(roots: list[Requirement]) -> dict[str, str]:
    """name -> installed version for every distribution the requirements pull in (markers evaluated here)."""
    environment = default_environment()
    found: dict[str, str] = {}
    pending = list(roots)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found or name in NOT_PINNED:
            continue
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here
        found[name] = dist.version
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None or child.marker.evaluate({**environment, "extra": ""}):
                pending.append(child)
    return found


def main() -> None:
    environment = default_environment()
    roots = [
        r
        for r in map(Requirement, metadata.requires("slipstream") or [])
        if r.marker is None
        or any(r.marker.evaluate({**environment, "extra": e}) for e in ("", "dev", "test", "monitor"))
    ]
    pins = closure(roots)
    lines = [
        "# Exact versions the test suite passes with (scripts/freeze_constraints.py; used by scripts/setup.sh).",
        "# The package's own ranges stay open; scripts/compat_check.sh tests their ends.",
        *(f"{name}=={version}" for name, version in sorted(pins.items()) if name not in TORCH_DEPENDENCIES),
    ]
    out = ROOT / "requirements" / "constraints.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(ROOT)}: {len(lines) - 2} pins", file=sys.stderr)


if __name__ == "__main__":
    main()
