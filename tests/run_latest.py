"""The integration tests against the newest release of every integrated library (``make test-latest``).

``make test`` runs the suite in ``.venv``, pinned by ``constraints.txt``. Users install whatever
is newest, so ``make test-latest`` refreshes a second environment, ``.venv-latest``, with the
newest release of each library below (no constraints; torch and torchvision as pinned in
``constraints.txt``), then runs this script in it: it runs the test files that exercise those
libraries (in parallel, as ``make test`` does) and prints, for each library, the pinned and the
installed version and the tests of its files that failed, so a red run says which new release
broke what. Its exit status is pytest's, or 1 when a library does not import or a coverage
table has a failure.

The coverage tables (``docs/coverage-timm.md``, ``docs/coverage-transformers.md``, made by
``tools/coverage``) describe the pinned releases, and a new release changes them by design (new model types every month), so
their ``test_coverage_table_is_current`` tests are left out here. This script builds both tables
itself instead: a family that crashes or is silently standard fails the run; a table that
differs from the committed page is printed as a notice (regenerate the page when the pin moves).

``python tests/run_latest.py --packages`` prints what pip installs (the libraries and the torch
pins); it needs nothing but the standard library.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: pip name -> (module, the test files that exercise it)
INTEGRATIONS: dict[str, tuple[str, list[str]]] = {
    "timm": ("timm", ["test_timm.py", "test_timm_coverage.py", "test_retrofit_vit.py"]),
    "transformers": (
        "transformers",
        [
            "test_transformers.py",
            "test_transformers_coverage.py",
            "test_heads_integrations.py",
            "test_other_trainers.py",
            "test_sharing.py",
        ],
    ),
    "peft": ("peft", ["test_retrofit.py", "test_retrofit_vit.py", "test_sharing.py"]),
    "accelerate": ("accelerate", ["test_other_trainers.py", "test_lm_eval.py"]),
    "lm-eval": ("lm_eval", ["test_lm_eval.py", "test_lm_eval_cli.py", "test_sharing.py"]),
    "datasets": ("datasets", ["test_hf_datasets.py", "test_lm_eval.py"]),
    "mlflow-skinny": ("mlflow", ["test_trackers.py"]),
    "wandb": ("wandb", ["test_trackers.py"]),
    "submitit": ("submitit", ["test_slurm.py"]),
    "pydantic": ("pydantic", ["test_config_models.py", "test_config_parsing.py"]),
}
#: installed as pinned (the CUDA build is large, and the tests check lapheads, not torch)
PINNED = ("torch", "torchvision")
#: library -> the committed coverage page, whose version-pinned comparison is left out here
COVERAGE = {"timm": "docs/coverage-timm.md", "transformers": "docs/coverage-transformers.md"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """``constraints.txt`` as ``{normalised name: version}``."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            out[_norm(name)] = version.strip()
    return out


def packages() -> list[str]:
    """What ``make test-latest`` installs besides ``lapheads[all,test]``: each library unpinned and
    torch / torchvision at their pins."""
    pinned = pins()
    return list(INTEGRATIONS) + [f"{name}=={pinned[name]}" for name in PINNED]


def _installed(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _results(junit: Path) -> dict[str, dict[str, list[str]]]:
    """``{test file: {"passed"|"failed"|"skipped": [test names]}}`` from pytest's JUnit XML."""
    out: dict[str, dict[str, list[str]]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = next((p for p in case.get("classname", "").split(".") if p.startswith("test_")), "?")
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        entry = out.setdefault(f"{module}.py", {"passed": [], "failed": [], "skipped": []})
        entry[outcome].append(case.get("name", "?"))
    return out


def coverage(library: str) -> dict:
    """Build ``library``'s coverage table (``tools/coverage``): ``{"failed": [family (model): why],
    "current": the committed page is unchanged, "summary": families and model types per status}``."""
    sys.path.insert(0, str(ROOT))  # tools/ is a repository tool, not part of the package
    from tools.coverage.__main__ import LIBRARIES
    from tools.coverage.table import counts

    rows, text = LIBRARIES[library][0](argparse.Namespace(only=None, no_reload=False))
    failed = [f"{r.family} ({r.model or '-'}): {r.detail}" for r in rows if r.status == "failed"]
    families, models = counts(rows)
    summary = "; ".join(
        f"{what}: " + ", ".join(f"{status} {n}" for status, n in c.items())
        for what, c in (("families", families), ("model types", models))
    )
    current = (ROOT / COVERAGE[library]).read_text(encoding="utf-8") == text
    return {"failed": failed, "current": current, "summary": summary}


def _coverage_runs() -> dict[str, subprocess.Popen]:
    """Both tables, each in a process of its own (started while nothing else runs: 2 cores)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return {
        lib: subprocess.Popen(
            [sys.executable, __file__, "--coverage", lib],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # a line per family; shown when the table fails to build
            text=True,
        )
        for lib in COVERAGE
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", action="store_true", help="print what pip installs, one per line, and exit")
    parser.add_argument("--coverage", choices=sorted(COVERAGE), help="build one coverage table; print it as JSON")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. -x)")
    args, more = parser.parse_known_args(argv)  # options such as -x go to pytest
    if args.packages:
        print("\n".join(packages()))
        return 0
    if args.coverage:
        print(json.dumps(coverage(args.coverage)))
        return 0

    broken = {}
    for dist, (module, _files) in INTEGRATIONS.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a library that does not import is what this reports
            broken[dist] = f"import {module} fails: {type(e).__name__}: {e}".splitlines()[0]
    files = sorted({f for _module, fs in INTEGRATIONS.values() for f in fs})
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lapheads-latest-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--dist", "loadgroup"]
        cmd += ["--durations=10", f"--junitxml={junit}", *[f"tests/{f}" for f in files], *args.pytest_args, *more]
        cmd += [f"--deselect=tests/test_{lib}_coverage.py::test_coverage_table_is_current" for lib in COVERAGE]
        rc = subprocess.call(cmd, cwd=ROOT)
        results = _results(junit) if junit.is_file() else {}
    tables = {}
    for lib, proc in _coverage_runs().items():
        out, err = proc.communicate()
        try:
            tables[lib] = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            print(err[-4000:], file=sys.stderr)
            tables[lib] = {"failed": [f"the coverage table was not built (exit status {proc.returncode})"]}

    pinned = pins()
    print(f"\nmake test-latest: {len(files)} test files against the newest releases (* newer than the pin)")
    print(f"{'library':<15}{'pinned':<11}{'installed':<15}tests of its files")
    for dist, (_module, its_files) in list(INTEGRATIONS.items()) + [(p, ("", [])) for p in PINNED]:
        pin, now = pinned.get(_norm(dist), "-"), _installed(dist)
        if dist in broken:
            result = broken[dist]
        elif not its_files:
            result = "(installed as pinned)"
        else:
            failed = [f"{f[:-3]}::{name}" for f in its_files for name in results.get(f, {}).get("failed", [])]
            passed, skipped = (
                sum(len(results.get(f, {}).get(k, [])) for f in its_files) for k in ("passed", "skipped")
            )
            result = f"FAILED {len(failed)}: {', '.join(failed)}" if failed else f"ok: {passed} passed"
            result += f", {skipped} skipped" if skipped and not failed else ""
        mark = " *" if pin not in ("-", now) else ""
        print(f"{dist:<15}{pin:<11}{now + mark:<15}{result}")
    for lib, table in tables.items():
        if table["failed"]:
            print(f"{lib} coverage table: FAILED {len(table['failed'])}: {'; '.join(table['failed'])}")
        else:
            note = "as in" if table["current"] else "differs from"
            print(f"{lib} coverage table: no failure ({table['summary']}); {note} {COVERAGE[lib]}")
    minutes, seconds = divmod(time.monotonic() - started, 60)
    print(f"in {int(minutes)} min {seconds:.0f} s; pytest's exit status {rc}")
    return rc or int(bool(broken) or any(t["failed"] for t in tables.values()))


if __name__ == "__main__":
    sys.exit(main())
