"""The optional compiled CPU kernel of the learnable path (``csrc/flash_mix.cpp``): build, find, load.

Learnable mixing (``laplacian_heads=HeadMix(a, b)``) on the CPU runs the attention and the mixing
``b_h P V + a_h V`` in one autograd node. The Python node (``ops._FlashMix``: SDPA's flash kernel,
then the mixing) costs a fixed ~0.2 ms per step and seven memory passes. The C++ node registered
here as ``lapheads::flash_mix`` costs a few microseconds; in float32 up to T = 1024 it runs its own
attention kernel with the mixing inside (no extra memory pass; :func:`float32_path` says whether it
does), elsewhere SDPA's flash kernel and three fused passes (benchmarks/attention.py measures all
of them). It is the same operator: results agree to rounding (tests/test_kernels.py checks both ways
against the explicit operator and the Python node, and the flash way against finite differences).

Design choices:

* Built ahead of time, never in the middle of a run: ``lapheads kernels build`` (``make setup``
  runs it) compiles with torch's own extension builder (``torch.utils.cpp_extension.load``, ninja
  and the system C++ compiler) into a per-user cache, ~30-60 s once. A process only LOADS an
  existing build (a file check the first time the learnable path runs). Without one, the Python
  node runs: slower, same operator; ``lapheads kernels status`` says which is in use.
* The build directory is keyed on everything the binary depends on: the source's hash, the torch
  version, the Python version, the machine, and the instruction-set flags it was compiled with
  (``-mavx2 -mfma``, and ``-mavx512f`` where this CPU has them), so a cache shared between machines
  or environments never loads a binary built for another one.
* ``LAPHEADS_KERNELS=0`` switches the compiled node off (the Python node runs);
  ``LAPHEADS_KERNEL_DIR`` moves the cache (default ``$XDG_CACHE_HOME/lapheads/kernels``, else
  ``~/.cache/lapheads/kernels``).
* A build that exists but does not load (a broken file, a changed system library) is a warning,
  once, and the Python node runs: speed changes, the operator does not.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from .errors import ConfigError

__all__ = ["SOURCE", "build", "cache_dir", "compile_flags", "flash_mix_op", "float32_path", "library_path",
           "status", "toolchain_problem"]

SOURCE = Path(__file__).with_name("csrc") / "flash_mix.cpp"
NAME = "lapheads_flash_mix"

_state: dict[str, Any] = {"tried": False, "op": None, "error": None}


def cache_dir() -> Path:
    """Where builds live: ``$LAPHEADS_KERNEL_DIR``, else ``$XDG_CACHE_HOME/lapheads/kernels``, else ``~/.cache/...``."""
    if os.environ.get("LAPHEADS_KERNEL_DIR"):
        return Path(os.environ["LAPHEADS_KERNEL_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lapheads" / "kernels"


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def compile_flags() -> list[str]:
    """``-O3``, plus ``-mavx2 -mfma`` on an x86-64 CPU that has both, and 512-bit vectors where it has AVX-512F
    (the build runs where it is used; the cache key includes these flags)."""
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma"]
        if "avx512f" in _cpu_flags():
            flags += ["-mavx512f", "-mprefer-vector-width=512"]
    return flags


def _key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, sys.version.split()[0], platform.machine(), " ".join(compile_flags())):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """The shared library this environment and CPU would load (it may not exist yet)."""
    return cache_dir() / f"{NAME}-{_key()}" / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile ``csrc/flash_mix.cpp`` into :func:`library_path` unless it is already there; then load it.

    Raises:
        ConfigError: no C++ compiler or ninja, the compilation failed (with the compiler's first
            error line), or the library does not load.
    """
    target = library_path()
    if not target.is_file():
        _compile(target, verbose)
    _state.update(tried=True, op=None, error=None)
    if not _load(target):
        raise ConfigError(f"{target} was built but does not load: {_state['error']}")
    return target


def _load(path: Path) -> bool:
    try:
        torch.ops.load_library(str(path))
        _state["op"] = torch.ops.lapheads.flash_mix.default
        return True
    except (OSError, RuntimeError, AttributeError) as e:
        _state["error"] = f"{path}: {e}"
        return False


def _cpp_extension() -> Any:
    """torch's extension builder, imported quietly (its import warns that no CUDA runtime exists)."""
    import logging
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension  # imported here: pulls in setuptools, only needed to build
    finally:
        logger.setLevel(level)
    return cpp_extension


def toolchain_problem() -> Optional[str]:
    """Why this machine cannot build the kernel (no ninja, no C++ compiler), or None when it can."""
    cpp_extension = _cpp_extension()
    venv_bin = os.path.dirname(sys.executable)  # pip's ninja lands next to the interpreter, maybe not on PATH
    if not shutil.which("ninja") and os.path.exists(os.path.join(venv_bin, "ninja")):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    if not cpp_extension.is_ninja_available():
        return "building the lapheads CPU kernel needs ninja: `pip install ninja` (or the system package)"
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx):
        return (f"building the lapheads CPU kernel needs a C++ compiler: {cxx!r} is not on PATH "
                f"(install g++ or clang, or set CXX)")
    return None


def _compile(target: Path, verbose: bool) -> None:
    problem = toolchain_problem()
    if problem:
        raise ConfigError(problem)
    cpp_extension = _cpp_extension()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=compile_flags(),
                           extra_ldflags=["-fopenmp"], build_directory=str(target.parent), is_python_module=False,
                           verbose=verbose)
    except (RuntimeError, OSError, SystemExit) as e:  # the compiler's own message is in the exception
        lines = str(e).strip().splitlines()
        first = next((ln.strip() for ln in lines if "error" in ln.lower() and "Error building" not in ln),
                     lines[-1].strip() if lines else repr(e))
        raise ConfigError(f"building {SOURCE} failed: {first} (run `lapheads kernels build --verbose` for the "
                          f"compiler's whole output)") from e


def flash_mix_op() -> Optional[Any]:
    """``torch.ops.lapheads.flash_mix.default`` when a build for this environment exists and loads, else None.

    Looked up once per process, when the learnable path first runs (``LAPHEADS_KERNELS=0`` read
    then: it returns None without looking); after that, one dictionary read per call.
    """
    if not _state["tried"]:
        _state["tried"] = True
        path = library_path()
        if _enabled() and path.is_file() and not _load(path):
            warnings.warn(f"lapheads: the compiled CPU kernel did not load ({_state['error']}); the learnable path "
                          f"runs its Python node (same operator, slower). Rebuild: `lapheads kernels build`",
                          RuntimeWarning, stacklevel=2)
    return _state["op"]


def _enabled() -> bool:
    return os.environ.get("LAPHEADS_KERNELS", "1").strip() != "0"


def status() -> dict[str, Any]:
    """What ``lapheads kernels status`` prints: the path, whether it exists, loads, and is switched on."""
    path = library_path()
    enabled = _enabled()
    op = flash_mix_op() if enabled else None
    return {"library": str(path), "built": path.is_file(), "enabled": enabled, "loaded": op is not None,
            "float32": float32_path() if op is not None else None,
            "error": _state["error"], "flags": " ".join(compile_flags()), "torch": torch.__version__}


def float32_path(t: int = 256) -> str:
    """Which way the loaded node computes a float32 call of length ``t``: ``"fused"`` (lapheads' own
    attention kernel with the mixing inside; float32, T <= 1024, a build with AVX2, torch's sgemm found) or
    ``"flash"`` (SDPA's CPU flash kernel plus fused mixing passes)."""
    if flash_mix_op() is None:
        raise RuntimeError("the compiled node is not loaded")
    x = torch.zeros(1, 1, t, 8)
    return str(torch.ops.lapheads.flash_mix_path(x, x, x))
