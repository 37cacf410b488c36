"""``lapheads sweep``: a recipe over Laplacian-head settings, seeds and config axes, resumably, then a report.

``--preset NAME`` runs a shipped grid (``--list-presets``); ``--launcher slurm`` submits one SLURM array job;
``--status OUT`` and ``--resume --out OUT`` read the command every sweep records in ``OUT/sweep_command.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from ..engine.config import read_yaml
from ..engine.run import lock_dir
from ..engine.slurm import SubmissionFailed, add_launcher_args, check_controller, launcher_config, print_status
from ..errors import ConfigError
from ..outputs import read_json, write_json
from ..recipes.shipped import resolve_any
from ..report import build_report
from ..runs import analyze_run
from ..sweep import (
    axis_names,
    design_points,
    parse_grid,
    parse_heads_list,
    parse_point,
    parse_seeds,
    run_grid,
    run_name,
)
from ..sweep_presets import load_preset, presets
from . import opts, repeated

COMMAND_FILE = "sweep_command.json"  # OUT/: the sweep's own argv (--status, --resume)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lapheads sweep",
        allow_abbrev=False,
        description="Run a recipe for several Laplacian-head settings and seeds, optionally crossed with "
        "config axes (--grid, --point), resumably; then write a report comparing them.",
    )
    p.add_argument("--config", help="recipe YAML (its top-level `recipe:` names the recipe)")
    p.add_argument("--recipe", help="recipe name when the YAML does not say it")
    p.add_argument(
        "--preset",
        help="a shipped sweep (its config, head settings, seeds, axes and settings; --list-presets lists them); "
        "--set adds settings, --laplacian-heads / --seeds replace its own",
    )
    p.add_argument("--list-presets", action="store_true", help="list the shipped sweep presets and exit")
    p.add_argument(
        "--laplacian-heads",
        help="comma-separated settings of model.laplacian_heads, e.g. 0,3,6 or 0,all (default 0,all)",
    )
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default 0)")
    grid_help = "a config axis crossed with every other --grid, k and seed (repeatable), e.g. model.embed_dim=64,128"
    repeated(p, "--grid", grid_help, metavar="KEY=V1,V2")
    point_help = (
        "one explicit design point (repeatable), for uneven designs, e.g. model.embed_dim=128,train.max_steps=400"
    )
    repeated(p, "--point", point_help, metavar="KEY=V,KEY2=V2")
    p.add_argument("--out", help="sweep directory (one run directory per grid point)")
    repeated(p, "--set", "override applied to every run (repeatable)", dest="overrides", metavar="KEY=VALUE")
    p.add_argument(
        "--overwrite", action="store_true", help="delete every existing run of the grid first and train them all afresh"
    )
    p.add_argument(
        "--restart-changed",
        action="store_true",
        help="train afresh the existing runs whose config differs from this command's (default: stop and list them)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained at once, each in its own process with the cores shared out "
        "(default 1: one run at a time, in this process)",
    )
    p.add_argument("--analyze", action="store_true", help="run the geometry analysis of every run")
    p.add_argument("--no-report", action="store_true", help="skip the report")
    p.add_argument(
        "--resume",
        action="store_true",
        help="with only --out: run the sweep recorded there again (its own flags), which skips the "
        "finished points (and, under SLURM, the queued ones) and continues the others",
    )
    p.add_argument(
        "--status",
        metavar="DIR",
        help="list each point of the sweep in DIR (pending, running with its job id, done, failed "
        "with its log's last lines) and exit",
    )
    add_launcher_args(p, sweep=True)
    return p


def _list_presets() -> int:
    found = presets()
    width = max(len(x.name) for x in found)
    for x in found:
        print(f"{x.name:<{width}}  {x.n_runs():>3} runs  {x.spec.config}: {x.description}")
    print("\nrun one with: lapheads sweep --preset NAME --out DIR [--set KEY=VALUE ...]")
    return 0


def _apply_preset(args: argparse.Namespace) -> None:
    """Fill ``args`` from ``--preset``: its config, axes and settings (``--set`` after them), and its head
    settings and seeds unless given."""
    given = [f for f, v in (("--config", args.config), ("--recipe", args.recipe)) if v]
    given += [f for f, v in (("--grid", args.grid), ("--point", args.point)) if v]
    if given:
        raise ConfigError(
            f"--preset {args.preset} sets the config and the axes itself; drop {', '.join(given)} "
            "(or give the sweep's own flags without --preset)"
        )
    preset = load_preset(args.preset)
    args.config = preset.config
    args.grid, args.point = list(preset.spec.grid), list(preset.spec.points)
    args.overrides = [*preset.spec.overrides, *args.overrides]
    args.laplacian_heads = args.laplacian_heads or ",".join(preset.heads)
    args.seeds = args.seeds or ",".join(str(s) for s in preset.seeds)


def _resolve(args: argparse.Namespace) -> None:
    """The sweep's own flags: a preset's, then the defaults of --laplacian-heads and --seeds."""
    if args.preset:
        _apply_preset(args)
    args.laplacian_heads = args.laplacian_heads or "0,all"
    args.seeds = args.seeds or "0"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    argv = list(argv or [])
    args = p.parse_args(argv)
    if args.list_presets:
        return _list_presets()
    if args.status:
        return _status(Path(args.status))
    if args.resume and args.config is None and args.preset is None:
        if args.out is None:
            raise ConfigError("--resume needs --out (the sweep directory)")
        argv = _recorded(Path(args.out), [a for a in argv if a != "--resume"])
        args = p.parse_args(argv)
    _resolve(args)
    if args.config is None or args.out is None:
        raise ConfigError(
            "the following arguments are required: "
            + ", ".join(f for f, v in (("--config or --preset", args.config), ("--out", args.out)) if v is None)
        )
    slurm = launcher_config(args)
    heads, seeds = parse_heads_list(args.laplacian_heads), parse_seeds(args.seeds)
    design = design_points(parse_grid(args.grid, args.overrides), [parse_point(x, args.overrides) for x in args.point])
    args.config = resolve_any(args.config, args.recipe)  # a path, or a shipped config's name
    recipe = read_yaml(args.config).get("recipe") or args.recipe
    if not recipe:
        raise ConfigError(f"{args.config} has no top-level `recipe:`; pass --recipe classify|lm|sft|dino")
    if args.recipe and recipe != args.recipe:
        raise ConfigError(f"{args.config} is a {recipe!r} recipe but --recipe says {args.recipe!r}")
    out = Path(args.out)
    if slurm is not None:  # an unreachable controller: one line, before anything is written
        check_controller()
    with lock_dir(out):
        record = [a for a in argv if a not in ("--overwrite", "--restart-changed", "--resume", "--no-wait")]
        config = str(Path(args.config).absolute()) if Path(args.config).is_file() else args.config
        if args.preset:
            config = ""  # a preset is read again by name (its argv holds --preset)
        recorded = (out / COMMAND_FILE).exists()

        def write_command() -> None:  # once the sweep is sure to run: a refused one changes nothing in OUT
            write_json(out / COMMAND_FILE, {"argv": record, "config": config, "cwd": str(Path.cwd())})

        try:
            dirs = run_grid(
                recipe,
                args.config,
                heads,
                seeds,
                out,
                args.overrides,
                design=design,
                launcher=slurm,
                wait=not args.no_wait,
                on_start=write_command,
                **opts(args, "overwrite restart_changed jobs slurm_folder"),
            )
        except SubmissionFailed:  # sbatch refused it: a new sweep leaves no record of a sweep that never ran
            if not recorded:
                (out / COMMAND_FILE).unlink(missing_ok=True)
            raise
        if slurm is not None and args.no_wait:
            print(
                f"[sweep] not waiting; `lapheads sweep --status {out}` shows the points, and "
                f"`lapheads sweep --resume --out {out}` writes the report once they are done"
            )
            return 0
        if args.analyze:
            for d in dirs:
                with lock_dir(d):
                    analyze_run(d)
        if not args.no_report:
            name = f"preset {args.preset}" if args.preset else Path(args.config).name
            paths = build_report(dirs, out / "report", title=f"Sweep: {name}")
            print(f"report: {paths['html']}")
    return 0


def _recorded(out: Path, given: Sequence[str]) -> list[str]:
    """The argv recorded in ``OUT/sweep_command.json`` (``--resume --out OUT``; only --no-wait may be added)."""
    data = _read_command(out)
    rest, skip = [], False
    for a in given:
        if skip or a == "--no-wait" or a.startswith("--out="):
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        rest.append(a)
    if rest:
        raise ConfigError(
            f"--resume --out {out} reruns the sweep recorded there unchanged; give only --no-wait "
            f"with it (not {' '.join(rest)}), or repeat the sweep's whole command"
        )
    # the recorded paths as they resolved then; --out as given now (argparse: the last one wins)
    config = [] if not data.get("config") else ["--config", data["config"]]
    return [*data["argv"], *config, "--out", str(out), *(["--no-wait"] if "--no-wait" in given else [])]


def _read_command(out: Path) -> dict:
    path = out / COMMAND_FILE
    if not path.exists():
        raise ConfigError(f"{out} holds no sweep ({path} is missing); pass the sweep's flags")
    data = read_json(path, "a sweep's record")
    if not isinstance(data, dict) or not isinstance(data.get("argv"), list):
        raise ConfigError(f"{path} is not a sweep's record; pass the sweep's flags")
    return data


def point_names(argv: Sequence[str]) -> list[str]:
    """The run directory names of the sweep ``argv`` (as run_grid names them), without loading configs."""
    args, _ = _parser().parse_known_args(list(argv))
    _resolve(args)
    design = design_points(parse_grid(args.grid, args.overrides), [parse_point(x, args.overrides) for x in args.point])
    short = axis_names(sorted({k for d in design for k in d}))
    return [
        run_name(k, s, d, short)
        for d in design
        for k in parse_heads_list(args.laplacian_heads)
        for s in parse_seeds(args.seeds)
    ]


def _status(out: Path) -> int:
    data = _read_command(out)
    names = point_names(data["argv"])
    print(f"sweep {out}: {len(names)} point(s)")
    return print_status(out, names)
