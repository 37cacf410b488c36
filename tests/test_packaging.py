"""The wheel works outside the repository, with and without extras.

The wheel is built from this checkout and installed non-editable (``--no-deps``) into fresh
virtualenvs in a temporary directory. Installing torch again would take minutes and gigabytes, so
each venv reuses what this environment has installed: a directory of symlinks to the installed
distributions it may see, added to the venv by a ``.pth`` file (``site.addsitedir``, so their own
``.pth`` files are processed too). The ``full`` venv sees every distribution of this environment
except lapheads itself (the editable install would shadow the wheel); the ``base`` venv sees only
torch, numpy and safetensors and what they require, which is what ``pip install lapheads``
brings. Every command runs from an empty directory outside the repository.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from _quickstart_checks import check_quickstart_tiny

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(md.distribution("torch").locate_file(""))  # this environment's site-packages

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheel")]


def _requirement_names(dist: md.Distribution) -> set[str]:
    """Names of the unconditional requirements of ``dist`` (extras left out)."""
    out = set()
    for req in dist.requires or []:
        name, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        if marker.strip() and "sys_platform" in marker and sys.platform not in marker:
            continue
        out.add(re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0])
    return out


def _closure(names: set[str]) -> set[str]:
    """The installed distributions ``names`` need, recursively (a requirement that is not installed
    here is skipped: e.g. a platform-specific one)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        n = todo.pop()
        key = n.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = md.distribution(n)
        except md.PackageNotFoundError:
            continue
        seen.add(key)
        todo.extend(_requirement_names(dist))
    return seen


def _top_level_entries(dist: md.Distribution) -> set[str]:
    """The entries of site-packages a distribution installed (packages, modules, its dist-info)."""
    entries = set()
    for f in dist.files or []:
        first = Path(f).parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            entries.add(first)
    return entries


def _link_site(dest: Path, allowed: set[str] | None) -> None:
    """Symlinks in ``dest`` to this environment's installed distributions (``allowed``: by name,
    None: all but lapheads)."""
    dest.mkdir(parents=True)
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "lapheads" or (allowed is not None and name not in allowed):
            continue
        for entry in _top_level_entries(dist):
            src, link = SITE / entry, dest / entry
            if src.exists() and not link.exists():
                link.symlink_to(src)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (whl,) = out.glob("lapheads-*.whl")
    return whl


def _venv(root: Path, wheel: Path, allowed: set[str] | None) -> Path:
    venv.create(root / "venv", with_pip=False)
    py = root / "venv" / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    _link_site(root / "deps", allowed)
    (purelib / "_lapheads_test_deps.pth").write_text(f"import site; site.addsitedir({str(root / 'deps')!r})\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    return py


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_holds_the_package_and_no_repository_tools(wheel):
    """The coverage harness (tools/coverage/) is a repository tool: neither it nor the modules it
    replaced are in the wheel."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "lapheads/timm/__init__.py" in names and "lapheads/ops.py" in names
    tops = {n.split("/", 1)[0] for n in names}
    assert tops <= {"lapheads", *(t for t in tops if t.startswith("lapheads-") and t.endswith(".dist-info"))}, tops
    assert not [n for n in names if "coverage" in n], names


def test_the_base_install_has_the_operator_and_names_the_missing_extras(wheel, tmp_path):
    base = _closure({"torch", "numpy", "safetensors"})
    py = _venv(tmp_path, wheel, base)
    empty = tmp_path / "empty"
    empty.mkdir()
    probe = r"""
import importlib.metadata as md, json, torch
import lapheads
from lapheads.nn import MultiheadAttention
q = k = v = torch.randn(1, 2, 5, 4)
out = lapheads.laplacian_attention(q, k, v, laplacian_heads="all")
ref, _ = lapheads.laplacian_attention_reference(q, k, v, laplacian_heads="all")
mha = MultiheadAttention(8, 2, laplacian_heads=1, batch_first=True)
y, _ = mha(torch.randn(1, 5, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8))
errors = {}
for name in ("lapheads.timm", "lapheads.transformers"):
    try:
        __import__(name)
    except ImportError as e:
        errors[name] = str(e)
print(json.dumps({"close": bool(torch.allclose(out, ref, atol=1e-6)), "shape": list(y.shape),
                  "errors": errors, "requires": md.requires("lapheads"), "file": lapheads.__file__}))
"""
    r = _run([str(py), "-c", probe], empty)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["close"] and got["shape"] == [1, 5, 8]
    assert str(tmp_path / "venv") in got["file"]  # the wheel, not this checkout
    assert "pip install timm" in got["errors"]["lapheads.timm"]
    assert "pip install 'transformers" in got["errors"]["lapheads.transformers"]
    unconditional = {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0] for r in got["requires"] if "extra ==" not in r}
    assert unconditional == {"torch", "numpy", "safetensors"}
    # a command of the train extra is one line naming the extra, not a traceback
    cli = _run([str(py.parent / "lapheads"), "train", "classify", "--config", "digits", "--out", "r"], empty)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and "lapheads[train]" in cli.stderr


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_full_install_runs_outside_the_repository(wheel, tmp_path):
    py = _venv(tmp_path, wheel, None)
    bin_ = py.parent
    work = tmp_path / "work"
    work.mkdir()
    r = _run([str(bin_ / "lapheads"), "--help"], work)
    assert r.returncode == 0 and "quickstart" in r.stdout, r.stderr
    r = _run([str(bin_ / "lapheads"), "recipes"], work)
    assert r.returncode == 0, r.stderr
    names = {line.split()[0] for line in r.stdout.splitlines() if line.strip() and not line.startswith(" ")}
    assert {"classify/digits", "lm/tiny", "sft/tiny"} <= names, r.stdout
    # a shipped recipe by name, from an empty directory
    r = _run(
        [
            str(bin_ / "lapheads"),
            "train",
            "classify",
            "--config",
            "digits",
            "--out",
            "digits",
            "--set",
            "train.max_steps=2",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.progress=false",
        ],
        work,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (work / "digits" / "final" / "model.safetensors").is_file()
    # the main job, end to end (the project's one quickstart run: every file, row and link checked)
    qs = work / "qs"
    r = _run([str(bin_ / "lapheads"), "quickstart", "--tiny", "--jobs", "1", "--out", str(qs)], work, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    check_quickstart_tiny(qs, r.stdout + r.stderr)
    # run it again: every finished run is reused, nothing is retrained
    before = {p: p.stat().st_mtime_ns for p in qs.glob("*/*/final/model.safetensors")}
    assert len(before) == 8
    r = _run([str(bin_ / "lapheads"), "quickstart", "--tiny", "--out", str(qs)], work, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in before} == before
    # the README's Python examples, with the installed wheel: one interpreter, each block in a fresh namespace
    blocks = _python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 3
    runner = "import json, sys\nfor i, b in enumerate(json.load(sys.stdin)):\n    exec(compile(b, f'README block {i}', 'exec'), {})\n"
    r = subprocess.run(
        [str(py), "-c", runner],
        cwd=work,
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
