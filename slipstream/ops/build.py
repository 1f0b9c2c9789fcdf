"""Build compiled ops ahead of time: ``python -m slipstream.ops.build [op ...]``.

Builds into the op cache (``$SLIPSTREAM_OPS_CACHE`` or ``~/.cache/slipstream/ops``), retrying
builds that failed before, and prints each op's status. ``setup.py`` calls
:func:`aot_extensions` when ``SLIPSTREAM_BUILD_OPS=1`` to compile them into the installed package.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from slipstream.ops import builder
from slipstream.ops.specs import ALL_OPS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.ops.build", description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", metavar="op", help=f"ops to build: {', '.join(ALL_OPS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops) - set(ALL_OPS))
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(ALL_OPS)}")
    failed = 0
    for name in args.ops or ALL_OPS:
        spec = ALL_OPS[name]
        state = builder.status(spec)
        if state.state == "fallback" and "earlier build failed" not in state.detail:
            print(f"{name}: skipped ({state.detail})")
            continue
        try:
            _, how = builder.build(spec, retry_failed=True)
        except builder.OpBuildError as err:
            failed += 1
            print(f"{name}: FAILED {err}")
            continue
        print(f"{name}: {how} ({builder.build_dir(spec)})")
    return 1 if failed else 0


def aot_extensions(root: str) -> tuple[list[Any], dict[str, Any]]:
    """setuptools ``ext_modules`` and ``cmdclass`` compiling every buildable op into the package.

    Each module carries the build key of its inputs, so :func:`builder.load` ignores a prebuilt
    op that no longer matches the installed torch or sources. ``root`` is setup.py's directory.
    """
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    extensions = []
    for name, spec in ALL_OPS.items():
        blocked = builder.status(spec)
        if blocked.state == "fallback":
            print(f"slipstream: not building op {name}: {blocked.detail}", file=sys.stderr)
            continue
        sources = [str(p.relative_to(root)) for p in builder.op_sources(spec)]
        key_flag = f"-DSLIPSTREAM_OP_KEY={builder.op_key(spec)}"
        compile_args: dict[str, list[str]] = {"cxx": [*builder.cflags(spec), key_flag]}
        factory = CppExtension
        if spec.cuda:
            compile_args["nvcc"] = [*spec.cuda_cflags, key_flag]
            factory = CUDAExtension
        extensions.append(
            factory(
                name=f"slipstream.ops._prebuilt.{spec.name}",
                sources=sources,
                include_dirs=[str(p) for p in builder.op_include_dirs(spec)],
                extra_compile_args=compile_args,
                extra_link_args=list(spec.ldflags),
            )
        )
    return extensions, {"build_ext": BuildExtension}


if __name__ == "__main__":
    sys.exit(main())
