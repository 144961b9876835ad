"""`lmlab scaling sweep budgets=[1e15,1e16,1e17] [n_sizes=7 mode=isoflop|wsd out=DIR launch=true] [OVERRIDES]`:
see `lmlab.scaling.sweep`.

`lmlab scaling plan flops=1e20 [fit=fits.json method=joint] [inference_tokens=1e12] [OVERRIDES]`: see
`lmlab.scaling.plan`.

`lmlab scaling collect RUNS... --out points.csv`: the points table of lmlab-train runs (see
`lmlab.scaling.collect`).

`lmlab scaling fit POINTS.csv`: every published fit the points support, with bootstrap intervals, what
each predicts at a compute budget, a JSON of the fits and PNG plots.

A points table has one row per (run, checkpoint): run, n, d, loss, and optionally c (FLOPs; default 6ND),
n_total and budget (the IsoFLOP budget a sweep planned the run for). Runs named "NAME@STEP" are one
training curve (the envelope and Kaplan fits read curves); rows with a budget feed the IsoFLOP fit.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from lmlab.errors import ConfigError
from lmlab.scaling.laws import (ComputeOptimal, FrontierFit, bootstrap_fits, curves_of, fit_envelope,
                                fit_isoflop, fit_joint, fit_kaplan, intervals, isoflop_residual_fits, law_from_json, loss_interval,
                                law_to_json)
from lmlab.scaling.plots import plot_envelope, plot_frontier, plot_isoflop, plot_residuals
from lmlab.scaling.points import Point, read_points, write_points


def fits_and_draws(points: list[Point], samples: int, seed: int) -> tuple[dict, dict[str, list], dict[str, str], str]:
    """(fits by method, their bootstrap refits, why a method did not apply, which points each method read).
    IsoFLOP runs only on rows with a budget and redraws each budget's residuals; the joint law resamples points,
    envelope and Kaplan whole runs' curves."""
    fits, draws, skipped = {}, {}, {}
    curves = list(curves_of(points).values())
    planned = [p for p in points if not math.isnan(p.budget)]
    finals = [curve[-1] for curve in curves]
    # method -> (its fit, the points it reads, its bootstrap refits given the fit and those points)
    methods = {
        # approach 3 on final losses only when the table has curves: intermediate checkpoints of a cosine
        # run sit above the loss a run planned for that length would reach. Each refit starts from the
        # full fit: the grid search is the slow part.
        "joint": (fit_joint, finals if any(len(c) > 1 for c in curves) else points,
                  lambda f, d: bootstrap_fits(lambda ps: fit_joint(ps, init=f), [[p] for p in d], samples, seed)),
        "isoflop": (fit_isoflop, planned, lambda f, d: isoflop_residual_fits(f, d, samples, seed)),
        "envelope": (fit_envelope, points, lambda f, d: bootstrap_fits(fit_envelope, curves, samples, seed)),
        "kaplan": (fit_kaplan, points, lambda f, d: bootstrap_fits(fit_kaplan, curves, samples, seed)),
    }
    for name, (fit, data, refits) in methods.items():
        try:
            fits[name] = fit(data)
        except ConfigError as err:
            skipped[name] = str(err)
            continue
        if samples:
            try:
                draws[name] = refits(fits[name], data)
            except ConfigError as err:  # the fit stands; only its intervals are missing
                skipped[f"{name} intervals"] = str(err)
    read = ", ".join(f"{name} {len(data)}" for name, (_, data, _) in methods.items())
    final_only = " (joint: each run's final point)" if len(methods["joint"][1]) < len(points) else ""
    return fits, draws, skipped, f"{len(points)} points of {len(curves)} runs; read by {read}{final_only}"


def _with_interval(value: float, interval: tuple[float, float] | None) -> str:
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def report(fits: dict, intervals_of: dict, skipped: dict[str, str], at: float, loss_ci: dict, read: str) -> str:
    lines = [read, f"{'method':<9} {'N* ~ C^a':<24} {'D* ~ C^b':<24} {'N*':>10} {'D*':>10} {'D*/N*':>7} "
             f"{'loss':<22}   (at C = {at:.3g} FLOPs; 95% bootstrap intervals)"]
    for name, fit in fits.items():
        params, ci = fit.params(), intervals_of.get(name, {})
        loss = _with_interval(float(fit.predicted_loss(at)), loss_ci.get(name))
        if not isinstance(fit, ComputeOptimal):
            lines.append(f"{name:<9} " + ", ".join(f"{k} {_with_interval(v, ci.get(k))}" for k, v in params.items()
                                                   if not k.endswith("_c")) + f"; L(C) {loss}")
            continue
        lines.append(f"{name:<9} {_with_interval(params['a'], ci.get('a')):<24} "
                     f"{_with_interval(params['b'], ci.get('b')):<24} {fit.n_opt(at):>10.3g} {fit.d_opt(at):>10.3g} "
                     f"{fit.tokens_per_parameter(at):>7.1f} {loss:<22}")
    if "joint" in fits:
        p, ci = fits["joint"].params(), intervals_of.get("joint", {})
        lines.append("joint law: L = E + A/N^alpha + B/D^beta with " +
                     ", ".join(f"{k} {_with_interval(p[k], ci.get(k))}" for k in ("E", "A", "B", "alpha", "beta")))
    lines += [f"{name}: not {'computed' if name.endswith('intervals') else 'fitted'}: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


def cmd_fit(args: argparse.Namespace) -> int:
    points = read_points(args.points)
    fits, draws, skipped, read = fits_and_draws(points, args.bootstrap, args.seed)
    if not fits:
        raise ConfigError("no fit applies to these points:\n" + "\n".join(f"  {k}: {v}" for k, v in skipped.items()))
    at = args.at or 10 * max(p.flops for p in points)
    ci = {name: intervals(d) for name, d in draws.items()}
    loss_ci = {name: loss_interval(d, at) for name, d in draws.items()}
    text = report(fits, ci, skipped, at, loss_ci, read)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fit.txt").write_text(text + "\n")
    # every method's predicted loss at `at` (Kaplan's L(C) too), so a run trained there checks them all
    summary = {name: {"params": fit.params(), "intervals": ci.get(name, {}), "at": at,
                      "predicted_loss": float(fit.predicted_loss(at)), "predicted_loss_interval": loss_ci.get(name),
                      **({"law": law_to_json(fit), "n_opt": float(fit.n_opt(at)), "d_opt": float(fit.d_opt(at))}
                         if isinstance(fit, ComputeOptimal) else {})}
               for name, fit in fits.items()}
    (args.out / "fits.json").write_text(json.dumps(summary, indent=1))
    if isinstance(fits.get("isoflop"), FrontierFit):
        plot_isoflop(fits["isoflop"], points, args.out / "isoflop.png")
    optimal = {k: v for k, v in fits.items() if isinstance(v, ComputeOptimal)}
    plot_frontier(optimal, args.out / "frontier.png", at, draws)
    plot_envelope(points, optimal, args.out / "envelope.png", at)
    if "joint" in fits:
        plot_residuals(fits["joint"], points, args.out / "residuals.png")
    print(f"fit.txt, fits.json and plots in {args.out}")
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    from lmlab.scaling.collect import collect

    points = collect(args.runs, args.loss_tag, args.budgets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_points(points, args.out)
    print(f"{len(points)} points of {len(curves_of(points))} runs -> {args.out}")
    return 0


def _flops_list(text: str) -> list[float]:
    """FLOP counts such as 1e17,1e18 or [1e17,1e18] (sweep's budgets=, collect's --budgets)."""
    try:
        return [float(b) for b in text.strip("[]").split(",") if b]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets are comma-separated FLOP counts such as 1e17,1e18; got {text!r}")


SHAPE_KEYS = {"aspect": float, "aspect_tolerance": float, "head_dim": int}  # ShapeRule's fields
PLAN_KEYS = {"flops": float, "fit": Path, "method": str, "inference_tokens": float, **SHAPE_KEYS}
SWEEP_KEYS = {"budgets": _flops_list, "n_sizes": int, "mode": str, "spread": float, "out": Path, "launch": bool, "parallel": int,
              "fit": Path, "method": str, "validations": int, **SHAPE_KEYS}
TRUE = {"true": True, "false": False, "1": True, "0": False}


def _settings(items: list[str], keys: dict, usage: str) -> tuple[dict, list[str]]:
    """key=value settings of the verb, and the rest: lmlab-train overrides of the model to size."""
    settings, overrides = {}, []
    for item in items:
        key, _, value = item.partition("=")
        if key not in keys:
            overrides.append(item)
            continue
        try:
            settings[key] = TRUE[value.lower()] if keys[key] is bool else keys[key](value)
        except argparse.ArgumentTypeError as err:
            raise ConfigError(f"{key}={value!r}: {err}") from None
        except (KeyError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a {getattr(keys[key], '__name__', 'value').strip('_')}") from None
    required = usage.split()[3].split("=")[0]  # the verb's first setting: "lmlab scaling VERB KEY=..."
    if required not in settings:
        raise ConfigError(f"{required}= is missing: {usage}")
    return settings, overrides


def _shape_rule(settings: dict):
    from lmlab.scaling.plan import ShapeRule

    return ShapeRule(**{key: settings[key] for key in SHAPE_KEYS if key in settings})


def _law_and_config(settings: dict, overrides: list[str]):
    from lmlab.cli.compose import compose_config
    from lmlab.scaling.plan import CHINCHILLA
    from lmlab.tokenizers.base import expected_vocab_size

    law, source = CHINCHILLA, "Chinchilla's published law (Hoffmann et al. 2022; its loss scale is not lmlab's)"
    if "method" in settings and "fit" not in settings:
        raise ConfigError(f"method={settings['method']} picks a law of fit=FILE (from lmlab scaling fit); without "
                          "fit= the plan uses Chinchilla's published law")
    if "fit" in settings:
        law, source = _law(settings["fit"], settings.get("method", "joint"))
    cfg = compose_config(overrides)
    return law, source, cfg, cfg.model.vocab_size or expected_vocab_size(cfg.tokenizer)


def cmd_plan(args: argparse.Namespace) -> int:
    from lmlab.scaling.plan import plan

    settings, overrides = _settings(args.settings, PLAN_KEYS, "lmlab scaling plan flops=1e20 [fit=fits.json "
                                    "method=joint] [inference_tokens=1e12] [lmlab-train overrides of the model to size]")
    law, source, cfg, vocab = _law_and_config(settings, overrides)
    report = plan(law, settings["flops"], cfg, vocab, settings.get("inference_tokens", 0.0), _shape_rule(settings),
                  overrides)  # its errors (flops=-1) come before any line
    print(f"law: {source}\n{report}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    import subprocess

    from lmlab.scaling.sweep import isoflop_jobs, script, wsd_jobs

    settings, overrides = _settings(args.settings, SWEEP_KEYS, "lmlab scaling sweep budgets=[1e15,1e16,1e17] "
                                    "[n_sizes=7 mode=isoflop|wsd spread=4 out=DIR launch=false parallel=1 validations=20 fit=FILE] "
                                    "[overrides]")
    modes = {"isoflop": isoflop_jobs, "wsd": wsd_jobs}
    mode = settings.get("mode", "isoflop")
    if mode not in modes:
        raise ConfigError(f"mode={mode!r}: the modes are {', '.join(modes)}")
    law, source, cfg, vocab = _law_and_config(settings, overrides)
    jobs = modes[mode](law, settings["budgets"], settings.get("n_sizes", 7), cfg, vocab, settings.get("spread", 4.0),
                       _shape_rule(settings), settings.get("validations", 20))
    out = (settings.get("out") or Path("outputs/scaling") / mode).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.sh").write_text(script(jobs, out, overrides, settings.get("parallel", 1)))
    (out / "jobs.json").write_text(json.dumps([{"name": j.name, "budget": j.budget, "flops": j.flops,
                                                "overrides": list(j.overrides), "after": j.after} for j in jobs], indent=1))
    print(f"sizes from {source}")
    for job in jobs:
        print(f"{job.name:<40} {job.flops:10.3g} FLOPs  {' '.join(job.overrides)}")
    print(f"{len(jobs)} jobs, {sum(j.flops for j in jobs):.3g} FLOPs in all: bash {out / 'sweep.sh'}")
    return subprocess.call(["bash", str(out / "sweep.sh")]) if settings.get("launch") else 0


def _law(path: Path, method: str) -> tuple[ComputeOptimal, str]:
    if not path.is_file():
        raise ConfigError(f"no such fit file: {path} (write one with `lmlab scaling fit`)")
    fits = json.loads(path.read_text())
    usable = [name for name, entry in fits.items() if "law" in entry]
    if method not in usable:
        raise ConfigError(f"{path} has no {method!r} law; it has {', '.join(usable) or 'none'}")
    return law_from_json(fits[method]["law"]), f"{method} fit in {path}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmlab scaling", description="scaling laws from lmlab's runs")
    sub = parser.add_subparsers(dest="command", required=True)
    p_collect = sub.add_parser("collect", help="points table (CSV) of lmlab-train run folders")
    p_collect.add_argument("runs", nargs="+", type=Path, help="run or multirun folders")
    p_collect.add_argument("--out", type=Path, default=Path("outputs/scaling/points.csv"))
    p_collect.add_argument("--loss-tag", default="val/loss", help="the logged loss each point takes (val/loss)")
    p_collect.add_argument("--budgets", type=_flops_list, default=[],
                           help="IsoFLOP budgets, e.g. 1e17,1e18: a run planned within 10%% of one carries it")
    p_collect.set_defaults(func=cmd_collect)
    p_plan = sub.add_parser("plan", help="N*, D*, loss and an lmlab config for a compute budget")
    p_plan.add_argument("settings", nargs="*", help="flops=1e20 [fit=FILE method=joint inference_tokens=N aspect=64 "
                                                    "aspect_tolerance=2 head_dim=64] and lmlab-train overrides of the model to size")
    p_plan.set_defaults(func=cmd_plan)
    p_sweep = sub.add_parser("sweep", help="lmlab-train jobs of an IsoFLOP or WSD sweep (a script; launch=true runs it)")
    p_sweep.add_argument("settings", nargs="*", help="budgets=[1e15,1e16,1e17] [n_sizes=7 mode=isoflop|wsd spread=4 "
                                                     "out=DIR launch=false parallel=1 validations=20 fit=FILE "
                                                     "method=joint] and lmlab-train overrides")
    p_sweep.set_defaults(func=cmd_sweep)
    p_fit = sub.add_parser("fit", help="every published fit of a points table, with intervals, predictions and PNGs")
    p_fit.add_argument("points", type=Path, help="points CSV (run, n, d, loss[, c, n_total, budget])")
    p_fit.add_argument("--out", type=Path, default=Path("outputs/scaling"), help="folder for fits.json and the PNGs")
    p_fit.add_argument("--bootstrap", type=int, default=200, help="refits for the intervals (0: none)")
    p_fit.add_argument("--seed", type=int, default=0)
    p_fit.add_argument("--at", type=float, help="compute budget of the predictions (default 10x the largest run's)")
    p_fit.set_defaults(func=cmd_fit)
    args = parser.parse_args(argv)
    return args.func(args)  # lmlab's main prints a ConfigError as one line, exit status 2
