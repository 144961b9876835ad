"""Where the decode megakernel's layer stack spends its time: every program stamps the GPU's global timer at eight
moments of each layer (the kernel's TIMELINE setting), and this prints where a layer's time goes, then draws it.

    python experiments/inference/timeline_megakernel.py --json timeline.json [--set GEMV_NUM_WARPS=8 ...]
    python experiments/inference/timeline_megakernel.py --from timeline.json --plot timeline.png

llama400m (vocab 50304, random weights, bf16), batch 1, one token at slot 255 of a 384-slot cache (as
sweep_megakernel.py), persistent, at the module's settings or those given with --set. A layer's time is cut along
the moments the next stage can start: q/k/v items (from the first program past the barrier to the last item done),
attention (to its last split), o_proj (to its last item), the barrier before gate/up (from the last program to
arrive to the first to leave), gate/up, the barrier before down, down, and the barrier before the next layer's
q/k/v. Each stage also gets its programs' own times (from leaving the barrier to finishing), median and largest:
a stage whose largest is well over its median waits on a few programs. The figures are medians over the middle
layers and the launches. The step's time with and without the stamps, in the same process, says what they cost.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics

import torch

# The eight moments each program stamps per layer, in the kernel's order, and the spans cut between them.
MOMENTS = ("qkv open", "qkv done", "attention done", "o_proj done", "gate/up open", "gate/up done", "down open",
           "down done")
# (span, from moment, taken over the programs as, to moment, taken as); moment 8 is the next layer's "qkv open"
SPANS = (("q/k/v", 0, min, 1, max), ("attention", 1, max, 2, max), ("o_proj", 2, max, 3, max),
         ("barrier before gate/up", 3, max, 4, min), ("gate/up", 4, min, 5, max), ("barrier before down", 5, max, 6, min),
         ("down", 6, min, 7, max), ("barrier before next q/k/v", 7, max, 8, min))
# (stage, the moment its programs start from, the moment they finish at)
OWN_TIMES = (("q/k/v", 0, 1), ("attention + o_proj", 1, 3), ("gate/up", 4, 5), ("down", 6, 7))


def measure(launches: int, settings: dict[str, int]) -> dict:
    """Stamps of `launches` persistent launches (after warm-up), as nested lists [launch][layer][moment][program]
    in ns, with the step's time in microseconds with and without the stamps."""
    from sweep_megakernel import stack_inputs  # this folder's: the same step the sweep times

    from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
    from lmlab.inference.megakernel import Megakernel
    from lmlab.kernels import decode_layers as dl
    from lmlab.kernels.decode_attention_triton import sm_count
    from lmlab.kernels.decode_layers_triton import layers_kernel

    for name, value in settings.items():
        setattr(dl, name, value)
    model, _ = build_model(DEFAULT_OVERRIDES, None, torch.device("cuda"), torch.bfloat16)
    x, w, k, v, slots, start, cos, sin, eps = stack_inputs(Megakernel(model), batch=1)
    n_layers = len(model.layers)

    def fresh_plan() -> dl.LaunchPlan:  # one a launch: its counters start at zero
        return dl.launch_plan(x, w.qkv, w.o, w.gate_up, w.down, w.scales, w.norm_attn, w.norm_ffn, k, v, slots, start,
                              cos, sin, w.n_heads, w.n_kv_heads, w.rope_interleaved, eps, w.head_dim ** -0.5,
                              sm_count(x.device))

    def launch(plan: dl.LaunchPlan, times: torch.Tensor | None) -> None:
        tensors = plan.args if times is None else (*plan.args[:-1], times)
        args = (*tensors, 0, n_layers, *plan.shape)
        layers_kernel[(dl.persistent_programs(plan, args),)](*args, STAGE=-1,
                                                              **{**plan.meta, "TIMELINE": times is not None})

    probe = fresh_plan()
    programs = dl.persistent_programs(probe, (*probe.args, 0, n_layers, *probe.shape))
    stamps, step_us = [], {}
    for stamped in (False, True):
        times = torch.zeros(n_layers, len(MOMENTS), programs, dtype=torch.int64, device="cuda") if stamped else None
        elapsed = []
        for i in range(5 + launches):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            plan = fresh_plan()  # its scratch made before the clock starts
            begin.record()
            launch(plan, times)
            end.record()
            torch.cuda.synchronize()
            if i >= 5:  # after warm-up (the first compiles)
                elapsed.append(begin.elapsed_time(end) * 1e3)
                if stamped:  # from the launch's first stamp: smaller numbers to write
                    stamps.append((times - times.min()).tolist())
        step_us["stamped" if stamped else "plain"] = statistics.median(elapsed)
    return {"settings": {name: getattr(dl, name) for name in settings}, "programs": programs, "step_us": step_us,
            "stamps": stamps}


def analyse(run: dict) -> dict:
    """Medians over the middle layers and the launches of each span and each stage's programs' own times, in us."""
    spans = {name: [] for name, *_ in SPANS}
    own = {name: ([], []) for name, *_ in OWN_TIMES}
    layer_us, resolution = [], []
    for launch in run["stamps"]:
        t = torch.tensor(launch, dtype=torch.float64) / 1e3  # (layer, moment, program), us
        diffs = t.flatten().unique().diff()
        resolution.append(diffs[diffs > 0].min().item())
        for layer in range(2, t.shape[0] - 2):  # the first and last layers start and end the step
            at = torch.cat([t[layer], t[layer + 1, :1]])  # moment 8: the next layer's qkv open
            for name, a, first, b, last in SPANS:
                spans[name].append((last(at[b]) - first(at[a])).item())
            layer_us.append((at[8].min() - at[0].min()).item())
            for name, a, b in OWN_TIMES:
                each = at[b] - at[a]
                own[name][0].append(each.median().item())
                own[name][1].append(each.max().item())
    return {"layer_us": statistics.median(layer_us), "timer_resolution_us": min(resolution),
            "spans_us": {name: statistics.median(v) for name, v in spans.items()},
            "own_us": {name: {"median": statistics.median(m), "largest": statistics.median(x)}
                       for name, (m, x) in own.items()}}


def report(run: dict, summary: dict) -> None:
    print(f"settings {run['settings'] or 'the module'}, {run['programs']} programs: the layer stack "
          f"{run['step_us']['plain']:.1f} us a step, {run['step_us']['stamped']:.1f} us stamped; "
          f"a middle layer {summary['layer_us']:.2f} us (timer resolution {summary['timer_resolution_us'] * 1e3:.0f} ns)")
    for name, us in summary["spans_us"].items():
        print(f"  {name:<28} {us:6.2f} us")
    for name, us in summary["own_us"].items():
        print(f"  programs' own time, {name:<20} median {us['median']:6.2f} us, largest {us['largest']:6.2f} us")


def plot(run: dict, path: str, layers: tuple[int, int] = (10, 12)) -> None:
    """Each program's stages over two middle layers of the last launch, one row per program."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = torch.tensor(run["stamps"][-1], dtype=torch.float64) / 1e3
    t = t[layers[0]:layers[1] + 1]
    t0 = t[0, 0].min()
    colours = ("tab:blue", "tab:orange", "tab:green", "lightgrey", "tab:red", "lightgrey", "tab:purple", "lightgrey")
    labels = ("q/k/v", "attention", "o_proj", "waiting", "gate/up", None, "down", None)
    fig, ax = plt.subplots(figsize=(12, 6))
    for layer in range(t.shape[0] - 1):
        at = torch.cat([t[layer], t[layer + 1, :1]]) - t0
        for moment in range(len(MOMENTS)):
            begin, end = at[moment], at[moment + 1]
            for program in range(at.shape[1]):
                ax.broken_barh([(begin[program].item(), (end[program] - begin[program]).item())], (program, 1),
                               color=colours[moment], label=labels[moment] if layer == program == 0 else None)
    ax.set_xlabel("us from layer %d's first q/k/v" % layers[0])
    ax.set_ylabel("program")
    ax.set_title(f"decode megakernel, llama400m batch 1: layers {layers[0]}-{layers[1] - 1}, {run['programs']} programs")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="module settings of lmlab.kernels.decode_layers (integers), e.g. GEMV_NUM_WARPS=8")
    parser.add_argument("--json", help="write the stamps and the summary here")
    parser.add_argument("--from", dest="source", help="read a run written by --json instead of measuring")
    parser.add_argument("--plot", help="draw the last launch's middle layers here (PNG)")
    args = parser.parse_args()
    if args.source:
        with open(args.source) as f:
            run = json.load(f)
    else:
        run = measure(args.launches, {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in args.set)})
    summary = analyse(run)
    report(run, summary)
    if args.json and not args.source:
        with open(args.json, "w") as f:
            json.dump({**run, "summary": summary}, f)
    if args.plot:
        plot(run, args.plot)


if __name__ == "__main__":
    main()
