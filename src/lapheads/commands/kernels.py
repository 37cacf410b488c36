"""``lapheads kernels build`` / ``lapheads kernels status``: the learnable path's compiled CPU node."""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from .. import kernels


def build_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lapheads kernels build",
                                description="Compile lapheads' CPU kernel for learnable head mixing into the "
                                            "per-user cache (once per torch version and CPU; ~30-60 s). Without "
                                            "it the learnable path runs its Python node: same operator, slower.")
    p.add_argument("--verbose", action="store_true", help="print the compiler's commands and output")
    args = p.parse_args(list(argv) if argv is not None else None)
    existed = kernels.library_path().is_file()
    if not existed:
        print(f"compiling {kernels.SOURCE.name} ({' '.join(kernels.compile_flags())}); this takes about a minute",
              flush=True)
    path = kernels.build(verbose=args.verbose)
    print(f"{'already built' if existed else 'built'}: {path}")
    return 0


def status_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lapheads kernels status",
                                description="Say whether the compiled CPU node of the learnable path is built, "
                                            "loads and is switched on (LAPHEADS_KERNELS=0 switches it off).")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = p.parse_args(list(argv) if argv is not None else None)
    st = kernels.status()
    if args.json:
        print(json.dumps(st))
        return 0
    node = "compiled C++ node (lapheads::flash_mix)" if st["loaded"] else "Python node (ops._FlashMix)"
    why = "" if st["loaded"] else (" (switched off by LAPHEADS_KERNELS=0)" if not st["enabled"] else
                                   f" (did not load: {st['error']})" if st["error"] else
                                   " (not built: run `lapheads kernels build`)")
    fp32 = ""
    if st["loaded"]:
        fp32 = ("\nfloat32, T <= 1024: lapheads' own attention kernel with the mixing inside (fused)"
                if st["float32"] == "fused" else
                "\nfloat32: SDPA's flash kernel and fused mixing passes (this build has no AVX2 exp, or torch's "
                "sgemm was not found)")
    print(f"learnable path on CPU: {node}{why}{fp32}\nlibrary: {st['library']}\nflags: {st['flags']}\n"
          f"torch: {st['torch']}")
    return 0
