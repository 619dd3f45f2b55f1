"""The planner's commands: `tflms simulate`, `demo`, `results`, `transformers`, `steadiness`,
`lookahead`.

Nothing heavy is imported at module level: `tflms --help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

_MACHINE_HELP = (
    "a real machine (GPU + its host link + host RAM): dgx1-v100 (default), ac922-v100, "
    "dgx-a100-40gb, dgx-a100-80gb, dgx-h100, gh200"
)
_GPU_HELP = (
    "modelled GPU: v100-16gb, v100-32gb, a100-40gb, a100-80gb, h100-80gb, gh200-96gb "
    "(on the link of the machine that has it)"
)
_LINK_HELP = (
    "what-if host link: pcie3, pcie4, pcie5, nvlink2-power9, c2c, or a bandwidth in GB/s per "
    "direction (default: the machine's own; another link makes the figures hypothetical)"
)


def add_parsers(sub: Any) -> None:
    # Light (the replay module imports the engine only when it runs).
    from tflms.planner.lookahead import LOOKAHEADS
    from tflms.planner.lookahead_sweep import SWEPT
    from tflms.planner.replay import DEFAULT_LOOKAHEAD, LAUNCH_QUEUE_DEPTH, PATCH_RUN_AHEAD_EPOCHS

    p = sub.add_parser(
        "simulate",
        help="will my model fit with LMS, and how much slower will it run? (replays a trace)",
        description=(
            "Replay a training-step trace through the LMS engine on a modelled GPU: peak memory "
            "without LMS, bytes swapped, page-in stalls and predicted step time with LMS, and "
            "(--max-batch / --max-size) the largest batch or input size that fits."
        ),
    )
    src = p.add_argument_group("trace (a file, or a model to trace)")
    src.add_argument("trace", nargs="?", help="trace file (.json or .json.gz) from `tflms trace`")
    src.add_argument("--model", help="trace this model instead (e.g. ResNet50, UNet3D); cached")
    src.add_argument(
        "--batch",
        type=int,
        help="batch size (rescales the trace; default 32, and 1 for the 3D U-Nets)",
    )
    src.add_argument(
        "--input-size",
        type=int,
        help="input edge for --model, or a transformer's sequence length (default: the model's)",
    )
    src.add_argument(
        "--precision",
        choices=("fp32", "mixed"),
        default="fp32",
        help="trace --model in fp32 (default) or mixed bfloat16 precision",
    )
    gpu = p.add_argument_group("modelled machine")
    gpu.add_argument("--machine", help=_MACHINE_HELP)
    gpu.add_argument("--gpu", help=_GPU_HELP)
    gpu.add_argument(
        "--memory",
        help="GPU memory for the allocator (default `tf`: the limit TensorFlow gives its "
        "allocator on this GPU by default, from its logs); `card`: the card's whole memory, "
        "or a size such as 24GiB (both hypothetical)",
    )
    gpu.add_argument(
        "--tflops", type=float, help="what-if effective compute rate in TFLOP/s (hypothetical)"
    )
    gpu.add_argument("--link", help=_LINK_HELP)
    gpu.add_argument(
        "--host-memory",
        "--host-limit",
        dest="host_limit",
        help="TensorFlow's pinned host pool limit per process (TF_GPU_HOST_MEM_LIMIT_IN_MB or "
        "GPUOptions.experimental.gpu_host_mem_limit_in_mb), e.g. 256GiB (default: TensorFlow's "
        "128GiB)",
    )
    gpu.add_argument(
        "--host-ram", help="the machine's host RAM, e.g. 1TiB (default: the machine's)"
    )
    gpu.add_argument(
        "--gpus-per-process",
        type=int,
        default=1,
        help="GPUs one TensorFlow process drives; they share its host limit (default 1)",
    )
    eng = p.add_argument_group("engine")
    eng.add_argument(
        "--prefetch",
        action="store_true",
        help="let the engine prefetch, each step's start marked (inside TensorFlow LMS's "
        "default, steps learned from the kernels' step ids, not yet run on a GPU)",
    )
    eng.add_argument(
        "--no-prefetch",
        action="store_true",
        help="page in on demand only (the planner's default; in TensorFlow, prefetch off)",
    )
    eng.add_argument("--defrag", action="store_true", help="enable defragmentation")
    eng.add_argument(
        "--fixed-addresses",
        action="store_true",
        help="the add-on's mode for the stock TensorFlow wheel: addresses fixed, 2 MiB "
        "pages mapped and unmapped behind them (map/unmap cost: --map-us/--unmap-us)",
    )
    eng.add_argument(
        "--map-us",
        type=float,
        help="host time per page mapped, in microseconds (default 24, measured on an H200)",
    )
    eng.add_argument(
        "--unmap-us",
        type=float,
        help="host time per page unmapped, in microseconds (default 17, measured on an H200)",
    )
    eng.add_argument("--steps", type=int, default=2, help="steps replayed; the last is measured")
    eng.add_argument(
        "--prefetch-lookahead",
        type=int,
        default=DEFAULT_LOOKAHEAD,
        help=f"pins prefetch looks ahead ({DEFAULT_LOOKAHEAD})",
    )
    eng.add_argument(
        "--prefetch-budget", help="bytes prefetch may hold ahead of use (default: memory / 8)"
    )
    eng.add_argument(
        "--launch-queue",
        type=int,
        default=LAUNCH_QUEUE_DEPTH,
        help=f"kernels the host may run ahead of the GPU (CUDA's launch queue, about "
        f"{LAUNCH_QUEUE_DEPTH} measured; 0: without bound)",
    )
    eng.add_argument(
        "--run-ahead-epochs",
        type=int,
        default=PATCH_RUN_AHEAD_EPOCHS,
        help="with prefetch: hold the host within this many last-use epochs "
        "(32 unpins each) of the GPU while tensors are on the host (TF_LMS_RUN_AHEAD_EPOCHS; "
        f"0: off; default {PATCH_RUN_AHEAD_EPOCHS}, the patch's; a value over the engine's "
        "bound is refused with the bound named)",
    )
    out = p.add_argument_group("what to do")
    out.add_argument(
        "--max-batch", action="store_true", help="search the largest batch without / with LMS"
    )
    out.add_argument(
        "--max-size",
        action="store_true",
        help="search the largest input size (cube edge, multiple of 16) without / with LMS; "
        "needs --model",
    )
    out.add_argument(
        "--tune-lookahead",
        action="store_true",
        help="also replay 30 steps with prefetch at each lookahead of --lookaheads and 6 "
        "paging on demand, and recommend the lookahead to set (or prefetch off)",
    )
    out.add_argument(
        "--lookaheads",
        default=",".join(str(v) for v in LOOKAHEADS),
        help=f"lookaheads --tune-lookahead tries (default {','.join(map(str, LOOKAHEADS))})",
    )
    out.add_argument("--no-compare", action="store_true", help="replay only the chosen LMS mode")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument(
        "--behind",
        action="store_true",
        help="also say where in the step the chosen LMS mode falls behind the ideal schedule "
        "(20 stretches of equal ideal time: the lag each adds, and how much of it is the "
        "compute stream waiting for page-ins)",
    )
    out.add_argument(
        "--placed",
        action="store_true",
        help="also place the ideal schedule (copies in issue order) with addresses: best fit, "
        "tensors moved at the device's copy rate where a request finds no hole (what addresses "
        "cost an offline schedule; docs/how-it-works.md)",
    )
    out.add_argument(
        "--unfragmented",
        action="store_true",
        help="also replay the chosen LMS mode with the engine's addresses taken out (4x the "
        "addresses, the device's bytes still limited): its step against the ideal is what its "
        "eviction and prefetch cost, the step as it runs against it what addresses cost",
    )
    out.add_argument(
        "--layout-lookahead",
        action="store_true",
        help="experimental, not set by the patch: with prefetch, place the step plan's copies "
        "in by a look-ahead over the learned step (each where every allocation of its stretch "
        "still finds room) instead of holding them back by the plan's slack",
    )
    out.add_argument(
        "--look-cost",
        type=float,
        default=1.0,
        metavar="X",
        help="with --layout-lookahead: the host time its looks are charged, as a multiple of "
        "what they took on the planner's own machine (default 1; 0: free, as before it was "
        "charged)",
    )
    out.add_argument("--plot", metavar="FILE.png", help="draw the memory timeline of a step")
    out.add_argument("--force", action="store_true", help="overwrite the --plot file")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_simulate)

    d = sub.add_parser(
        "demo",
        help="ResNet50 on a 16 GB V100 (PCIe 3 and NVLink 2 machines): largest batch, overhead",
        description=(
            "Trace ResNet50 (once, cached), then find the largest batch without and with LMS on "
            "a modelled 16 GB V100 in the two real machines that have it (DGX-1 on PCIe 3, "
            "AC922 on NVLink 2), say whether the GPU or the host side stops the batch, and "
            "predict the step-time overhead at 4x the batch."
        ),
    )
    d.add_argument("--json", action="store_true", help="print JSON instead of tables")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser(
        "results",
        help="regenerate docs/results.md (largest batches and overheads of five models)",
    )
    r.add_argument("--output", default="docs/results.md", help="markdown file to write")
    r.add_argument(
        "--json-output",
        help="also write the raw results as JSON here; with --models/--gpus, studies already "
        "in this file are kept and the rerun ones replaced",
    )
    r.add_argument("--force", action="store_true", help="overwrite a file tflms did not write")
    r.add_argument("--models", help="comma-separated subset, e.g. ResNet50,UNet3D")
    r.add_argument(
        "--machines",
        "--gpus",
        dest="machines",
        help="comma-separated subset of the studied machines (dgx1-v100, ac922-v100, ...) or "
        "of their GPUs (v100-16gb, ...)",
    )
    r.add_argument(
        "--from-json", metavar="FILE", help="rewrite the markdown from a saved --json-output"
    )
    r.add_argument(
        "--refresh-yardsticks",
        action="store_true",
        help="with --from-json: recompute the yardsticks of every saved row (no engine "
        "replay; minutes) and save them into that file before rewriting the markdown",
    )
    r.add_argument(
        "--gpu-bench",
        metavar="JSON",
        help="with --from-json: keep this `make bench-cuda` JSON (measured on a GPU) in the "
        "saved results and render it as the page's 'Measured on a GPU'",
    )
    r.add_argument(
        "--gpu-baseline",
        metavar="JSON",
        help="with --gpu-bench: the same benchmark over an earlier engine, shown beside it",
    )
    r.add_argument(
        "--gpu-engine",
        metavar="TEXT",
        help="with --gpu-bench: which engine it measured, as the page should name it "
        "(e.g. 'commit 5933cb4')",
    )
    r.add_argument(
        "--gpu-baseline-engine",
        metavar="TEXT",
        help="with --gpu-baseline: which engine the baseline measured, as the page should "
        "name it (e.g. 'the engine of the previous GPU run, commit 7c4d310')",
    )
    r.add_argument(
        "--calibrate",
        action="store_true",
        help="only print the compute efficiencies that match the published throughputs",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.set_defaults(func=cmd_results)

    t = sub.add_parser(
        "transformers",
        help="regenerate docs/transformers.md (keras-hub GPT-2, BERT, Llama on 16 GB V100s)",
        description="Trace keras-hub language models (random weights, nothing downloaded) and "
        "replay them with and without LMS: parameter scaling, sequence-length scaling, and GPT-2 "
        "1.5B with Adam in fp32 on a 16 GiB GPU. Needs keras-hub (`make install` adds it).",
    )
    t.add_argument("--output", default="docs/transformers.md", help="markdown file to write")
    t.add_argument("--json-output", help="also write the raw results as JSON here")
    t.add_argument("--from-json", metavar="FILE", help="rewrite the markdown from saved JSON")
    t.add_argument("--quick", action="store_true", help="GPT-2 355M only: check the pipeline")
    t.add_argument("--force", action="store_true", help="overwrite a file tflms did not write")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_transformers)

    st = sub.add_parser(
        "steadiness",
        help="replay every point of docs/results.md for longer: is one step the mean?",
        description="docs/results.md reports one step per row (on demand the second, with "
        "prefetch the 20th). Replay every point of a saved results JSON for more steps and "
        "report the mean, the fastest and the slowest step of each mode, and whether prefetch "
        "wins by the means (docs/steadiness.md).",
    )
    st.add_argument("--results", default="docs/results.json", help="the saved `tflms results` JSON")
    _page_run_options(st, "docs/steadiness.md")
    st.set_defaults(func=cmd_steadiness)

    la = sub.add_parser(
        "lookahead",
        help="replay every point of docs/steadiness.md with prefetch at other lookaheads",
        description="Replay every point of a saved steadiness JSON with prefetch at other "
        "lookaheads (30 steps each, from fresh engines) and report which is fastest where "
        "against paging on demand and the default (docs/lookahead.md).",
    )
    la.add_argument(
        "--steadiness", default="docs/steadiness.json", help="the saved `tflms steadiness` JSON"
    )
    la.add_argument(
        "--lookaheads",
        default=",".join(map(str, SWEPT)),
        help=f"lookaheads to replay (default {','.join(map(str, SWEPT))})",
    )
    _page_run_options(la, "docs/lookahead.md")
    la.set_defaults(func=cmd_lookahead)


def _page_run_options(p: Any, output: str) -> None:
    """The options of a command that replays saved points and writes a page of them."""
    p.add_argument("--output", default=output, help="markdown file to write")
    p.add_argument("--json-output", help="also write the step times as JSON here")
    p.add_argument("--from-json", metavar="FILE", help="rewrite the markdown from saved JSON")
    p.add_argument("--only", help="only the points whose label contains this text")
    p.add_argument(
        "--jobs", type=int, default=0, help="replays at a time (default: one per CPU core)"
    )
    p.add_argument("--force", action="store_true", help="overwrite a file tflms did not write")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fail(msg: str) -> int:
    print(f"tflms: error: {msg}", file=sys.stderr)
    return 2


def _check_writable(path: Path, force: bool, marker: str | None = None) -> str | None:
    """None if `path` may be written, else the reason."""
    if not path.exists() or force:
        return None
    if marker is not None:
        try:
            with path.open(encoding="utf-8") as f:
                if f.readline().strip() == marker:
                    return None
        except (OSError, UnicodeDecodeError):
            pass
    return f"{path} exists; pass --force to overwrite it"


def _rewrite_from_json(saved: Path, out: Path, render: Any) -> int:
    """Writes `out` from the JSON a long run saved, without running it again."""
    try:
        text = render(json.loads(saved.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"cannot rebuild {out} from {saved}: {exc}")
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _engine_ready() -> str | None:
    try:
        import tflms

        tflms.Engine  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return (
            f"the LMS engine is not built ({exc}); install the package with "
            "`pip install -e .` so tflms._core is compiled"
        )
    return None


def cmd_simulate(args: argparse.Namespace) -> int:
    from tflms.planner import gpu as gpus
    from tflms.planner.lookahead import format_tuning, parse_lookaheads, tune_lookahead
    from tflms.planner.simulate import FixedPages, max_batch, max_size, simulate_step

    if bool(args.trace) == bool(args.model):
        return _fail("give a trace file or --model NAME (one of them)")
    if args.max_size and not args.model:
        return _fail("--max-size re-traces the model at each size: use --model NAME")
    if args.steps < 1:
        return _fail("--steps must be at least 1")
    if args.batch is not None and args.batch < 1:
        return _fail("--batch must be at least 1")
    try:
        machine = machine_from_args(args)
        budget = gpus.parse_size(args.prefetch_budget) if args.prefetch_budget else 0
    except ValueError as exc:
        return _fail(str(exc))
    gpu = machine.gpu
    link_name = machine.link_name
    if args.prefetch_lookahead < 0:
        return _fail("--prefetch-lookahead must be 0 or more")
    if args.launch_queue < 0:
        return _fail("--launch-queue must be 0 (no bound) or more")
    from tflms.engine import MAX_RUN_AHEAD_EPOCHS

    if not 0 <= args.run_ahead_epochs <= MAX_RUN_AHEAD_EPOCHS:
        return _fail(
            f"--run-ahead-epochs must be 0 (off) to {MAX_RUN_AHEAD_EPOCHS}: the engine keeps "
            f"the events of {MAX_RUN_AHEAD_EPOCHS + 1} epochs"
        )
    try:
        lookaheads = parse_lookaheads(args.lookaheads)
    except ValueError as exc:
        return _fail(str(exc))
    if args.tune_lookahead and args.fixed_addresses:
        return _fail("--tune-lookahead tunes the patch's prefetch: drop --fixed-addresses")
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            return _fail("--plot writes a PNG: give a file name ending in .png")
        reason = _check_writable(Path(args.plot), args.force)
        if reason:
            return _fail(reason)
    reason = _engine_ready()
    if reason:
        return _fail(reason)
    machine = dataclasses.replace(
        machine,
        prefetch_lookahead=args.prefetch_lookahead,
        prefetch_budget=budget,
        launch_queue_depth=args.launch_queue,
        run_ahead_epochs=args.run_ahead_epochs,
        layout_lookahead=args.layout_lookahead,
        layout_look_cost=args.look_cost,
    )
    if args.layout_lookahead and not args.prefetch:
        return _fail("--layout-lookahead places the copies in of prefetch's plan: add --prefetch")
    if args.look_cost != 1.0 and not args.layout_lookahead:
        return _fail("--look-cost prices the looks of --layout-lookahead: add it")
    if args.look_cost < 0:
        return _fail("--look-cost must be 0 or more (0: the looks are free)")
    if (args.map_us is not None or args.unmap_us is not None) and not args.fixed_addresses:
        return _fail("--map-us and --unmap-us apply to --fixed-addresses only")
    if args.fixed_addresses:
        costs = {
            k: v
            for k, v in (("map_us_per_page", args.map_us), ("unmap_us_per_page", args.unmap_us))
            if v is not None
        }
        if any(v < 0 for v in costs.values()):
            return _fail("--map-us and --unmap-us must be 0 or more")
        if args.defrag:
            return _fail("--defrag does nothing with --fixed-addresses: no buffer moves")
        if args.unfragmented:
            return _fail(
                "--unfragmented takes fragmentation out of the patch's mode; "
                "--fixed-addresses has none to take out"
            )
        machine = dataclasses.replace(machine, fixed=FixedPages(**costs))
    progress = not args.no_progress and sys.stderr.isatty()

    try:
        trace = _load_trace(args, progress)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    if args.batch is not None and args.batch != trace.batch_size:
        trace = trace.rescaled(args.batch)

    if args.prefetch and args.no_prefetch:
        return _fail("--prefetch and --no-prefetch contradict each other")
    prefetch = bool(args.prefetch)
    report, recorded = simulate_step(
        trace,
        machine,
        steps=args.steps,
        prefetch=prefetch,
        defrag=args.defrag,
        compare=not args.no_compare,
        record=bool(args.plot),
        progress=progress,
        behind=args.behind,
        placed=args.placed,
        unfragmented=args.unfragmented,
    )
    if args.max_batch:
        try:
            report["max_batch"] = max_batch(
                trace,
                machine,
                prefetch=prefetch,
                defrag=args.defrag,
                steps=args.steps,
                progress=progress,
            )
        except ValueError as exc:
            return _fail(str(exc))
    if args.max_size:
        from tflms.trace.cache import cached_trace

        model, batch, precision = args.model, trace.batch_size, args.precision
        report["max_size"] = max_size(
            lambda size: cached_trace(model, batch, input_size=size, precision=precision),
            machine,
            start_size=args.input_size or _default_size(model),
            prefetch=prefetch,
            defrag=args.defrag,
            steps=args.steps,
            progress=progress,
        )
    tuning = None
    if args.tune_lookahead:
        tuning = tune_lookahead(trace, machine, lookaheads, progress=progress)
        report["lookahead"] = tuning.to_json()
    if args.plot and recorded is not None:
        from tflms.planner.plot import plot_timeline

        if recorded.fits:
            plot_timeline(
                recorded.samples,
                args.plot,
                title=f"{trace.model} batch {trace.batch_size}, {recorded.config.label()}, "
                f"{gpu.name} {gpus.format_bytes(gpu.memory_bytes)}, {link_name}",
                device_memory=gpu.memory_bytes,
            )
            report["plot"] = args.plot
        else:
            print(
                f"tflms: no plot: the step does not fit ({recorded.oom_message})", file=sys.stderr
            )

    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        from tflms.planner.report import format_max_batch, format_simulate

        print(format_simulate(report))
        if "max_batch" in report:
            print()
            print(format_max_batch(report["max_batch"]))
        if "max_size" in report:
            print()
            print(format_max_batch(report["max_size"], what="input size"))
        if tuning is not None:
            print()
            print(format_tuning(tuning))
        if "behind_ideal" in report:
            from tflms.planner.behind import format_behind

            print()
            print(format_behind(report["behind_ideal"]))
        elif args.behind:
            print("\nNo comparison with the ideal schedule: the step or the schedule does not fit.")
        if "unfragmented" in report:
            from tflms.planner.unfragmented import format_unfragmented

            print()
            print(format_unfragmented(report["unfragmented"]))
        if "placed_ideal" in report:
            from tflms.planner.placed import format_placed

            print()
            print(format_placed(report["placed_ideal"]))
        elif args.placed:
            print("\nNo placed ideal schedule: the ideal schedule does not fit.")
        if "plot" in report:
            print(f"\nmemory timeline: {report['plot']}")
    return 0


def machine_from_args(args: argparse.Namespace) -> Any:
    """The modelled machine: a real pairing, changed only where the flags say (what-ifs)."""
    from tflms.planner import gpu as gpus
    from tflms.planner import machines
    from tflms.planner.host import MIB
    from tflms.planner.simulate import Machine

    if args.machine and args.gpu:
        raise ValueError("give --machine or --gpu, not both (a machine has its own GPU)")
    what_if: list[str] = []
    if args.gpu:
        gpu = gpus.get_gpu(args.gpu)
        owners = machines.pairings_for_gpu(gpu.name)
        if owners:
            pairing = owners[0]
        else:
            pairing = machines.get_pairing(machines.DEFAULT_PAIRING)
            what_if.append(f"{gpu.name} in {pairing.name}'s place (no modelled machine has it)")
    else:
        pairing = machines.get_pairing(args.machine or machines.DEFAULT_PAIRING)
        gpu = pairing.gpu_model
    link_name, link_gbps = pairing.link, pairing.link_gbps
    if args.link:
        link_name, link_gbps = gpus.parse_link(args.link)
        other = machines.real_pairing(gpu.name, link_name)
        if other is not None:
            pairing = other
        elif link_name != pairing.link or link_gbps != pairing.link_gbps:
            what_if.append(f"{gpu.name} on {link_name} (no such machine)")
    memory = (args.memory or "").strip().lower()
    if memory == "card":
        gpu, what = gpu.whole_card()
        what_if.append(what)
    elif memory and memory != "tf":  # "tf": TensorFlow's own limit, the default
        size = gpus.parse_size(args.memory)
        if size != gpu.memory_bytes:
            what_if.append(f"{gpus.format_bytes(size)} of GPU memory")
            gpu = gpu.with_memory(size)
    if args.tflops is not None:
        if args.tflops <= 0:
            raise ValueError("--tflops must be positive")
        what_if.append(f"{args.tflops:g} effective TFLOP/s")
        gpu = gpu.with_tflops(args.tflops)
    if args.gpus_per_process < 1 or args.gpus_per_process > pairing.gpus:
        raise ValueError(
            f"--gpus-per-process must be between 1 and {pairing.gpus} ({pairing.name}'s GPUs)"
        )
    host = pairing.host(gpus_per_process=args.gpus_per_process)
    if args.host_ram:
        host = dataclasses.replace(host, ram_bytes=gpus.parse_size(args.host_ram))
    if args.host_limit:
        host = host.with_limit_mb(gpus.parse_size(args.host_limit) / MIB)
    if host.lms_bytes <= 0:
        raise ValueError(
            f"no host memory is left for LMS: {gpus.format_bytes(host.ram_bytes)} of RAM over "
            f"{host.processes} processes, each needing {gpus.format_bytes(host.reserve_bytes)} "
            "for itself (--host-ram)"
        )
    return Machine(
        gpu,
        link_name,
        link_gbps,
        host.lms_bytes,
        host_side=host,
        pairing=pairing.name,
        what_if=tuple(what_if),
    )


def _default_size(model: str) -> int:
    from tflms.trace.models import MODEL_SPECS, resolve_model_name

    return MODEL_SPECS[resolve_model_name(model)].default_size


def _default_batch(model: str) -> int:
    from tflms.trace.models import MODEL_SPECS, resolve_model_name

    return MODEL_SPECS[resolve_model_name(model)].default_batch


def _load_trace(args: argparse.Namespace, progress: bool) -> Any:
    from tflms.trace.cache import cached_trace
    from tflms.trace.format import load_trace
    from tflms.trace.models import resolve_model_name

    if args.trace:
        return load_trace(args.trace)
    model = resolve_model_name(args.model)
    return cached_trace(
        model,
        args.batch or _default_batch(model),
        input_size=args.input_size,
        progress=progress,
        precision=args.precision,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    reason = _engine_ready()
    if reason:
        return _fail(reason)
    from tflms.planner.report import format_demo
    from tflms.planner.study import run_demo

    demo = run_demo(progress=not args.no_progress and sys.stderr.isatty())
    if args.json:
        json.dump(demo, sys.stdout, indent=2)
        print()
    else:
        print(format_demo(demo))
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    reason = _engine_ready()
    if reason:
        return _fail(reason)
    from tflms.planner import study
    from tflms.planner.report import RESULTS_MARKER, results_markdown

    if args.calibrate:
        for row in study.run_calibration(fit=True):
            fitted = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith("fitted_"))
            print(
                f"{row['gpu']}: published {row['published_per_s']:.0f}/s, modelled "
                f"{row['modelled_per_s']:.0f}/s (compute efficiency "
                f"{row['compute_efficiency']:.3f}, memory traffic {row['memory_traffic']:.3f}); "
                f"{fitted}"
            )
        return 0
    out = Path(args.output)
    reason = _check_writable(out, args.force, RESULTS_MARKER)
    if reason:
        return _fail(reason)
    if (args.gpu_bench or args.gpu_baseline) and not args.from_json:
        return _fail("--gpu-bench and --gpu-baseline go with --from-json")
    if args.gpu_baseline and not args.gpu_bench:
        return _fail("--gpu-baseline needs --gpu-bench")
    if args.gpu_engine and not args.gpu_bench:
        return _fail("--gpu-engine needs --gpu-bench")
    if args.gpu_baseline_engine and not args.gpu_baseline:
        return _fail("--gpu-baseline-engine needs --gpu-baseline")
    if args.gpu_bench:
        from tflms.planner.gpu_report import attach

        saved = Path(args.from_json)
        try:
            res = attach(
                json.loads(saved.read_text(encoding="utf-8")),
                Path(args.gpu_bench),
                Path(args.gpu_baseline) if args.gpu_baseline else None,
                engine=args.gpu_engine,
                baseline_engine=args.gpu_baseline_engine,
            )
        except (OSError, ValueError) as exc:
            return _fail(f"cannot add the GPU measurements: {exc}")
        saved.write_text(json.dumps(res, indent=2), encoding="utf-8")
        print(f"kept {args.gpu_bench} in {saved}")
    if args.refresh_yardsticks:
        if not args.from_json:
            return _fail("--refresh-yardsticks goes with --from-json")
        saved = Path(args.from_json)
        try:
            res = json.loads(saved.read_text(encoding="utf-8"))
            moved = study.refresh_yardsticks(
                res, progress=not args.no_progress and sys.stderr.isatty()
            )
        except (OSError, ValueError, KeyError) as exc:
            return _fail(f"cannot refresh the yardsticks of {saved}: {exc}")
        for line in moved:
            print(f"moved: {line}", file=sys.stderr)
        saved.write_text(json.dumps(res, indent=2), encoding="utf-8")
        print(f"refreshed the yardsticks in {saved} ({len(moved)} ideal step times moved)")
    if args.from_json:
        return _rewrite_from_json(Path(args.from_json), out, results_markdown)
    models = study.RESULT_MODELS
    if args.models:
        wanted = {m.strip().lower() for m in args.models.split(",") if m.strip()}
        models = tuple(m for m in models if m.name.lower() in wanted)
        unknown = wanted - {m.name.lower() for m in models}
        if unknown:
            names = ", ".join(m.name for m in study.RESULT_MODELS)
            return _fail(f"unknown model(s) {', '.join(sorted(unknown))}: choose from {names}")
    machines = study.RESULT_MACHINES
    if args.machines:
        wanted = {g.strip().lower() for g in args.machines.split(",") if g.strip()}
        machines = tuple(
            m for m in machines if m.name in wanted or any(p in wanted for p in m.pairings)
        )
        if not machines:
            names = ", ".join(p for m in study.RESULT_MACHINES for p in m.pairings)
            return _fail(f"--machines matches none of the studied machines: {names}")

    # A subset run on top of saved results replaces only the studies it reruns.
    previous: dict[str, Any] | None = None
    subset = bool(args.models or args.machines)
    if subset and args.json_output and Path(args.json_output).exists():
        try:
            previous = json.loads(Path(args.json_output).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return _fail(f"cannot read the saved results {args.json_output}: {exc}")

    # What a GPU measured (--gpu-bench) is not rerun here: it stays in the saved results.
    kept_gpu: Any = None
    if args.json_output and Path(args.json_output).exists():
        try:
            kept_gpu = json.loads(Path(args.json_output).read_text(encoding="utf-8")).get(
                "gpu_measured"
            )
        except (OSError, ValueError, AttributeError):
            kept_gpu = None

    def save(res: dict[str, Any]) -> None:
        # Written after every study, so a long run that is stopped keeps what it found.
        if previous is not None:
            res = study.merge_results(previous, res)
        if kept_gpu is not None:
            res = {**res, "gpu_measured": kept_gpu}
        if args.json_output:
            Path(args.json_output).write_text(json.dumps(res, indent=2), encoding="utf-8")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(results_markdown(res), encoding="utf-8")

    res = study.run_results(
        models=models,
        machines=machines,
        progress=not args.no_progress and sys.stderr.isatty(),
        log=lambda s: print(s, file=sys.stderr),
        on_study=save,
        earlier_studies=previous.get("studies") if previous else None,
    )
    save(res)
    print(f"wrote {out} ({res['wall_s'] / 60:.1f} min of replays)")
    return 0


def cmd_transformers(args: argparse.Namespace) -> int:
    reason = _engine_ready()
    if reason:
        return _fail(reason)
    from tflms.planner.transformers import (
        TRANSFORMERS_MARKER,
        run_transformers,
        transformers_markdown,
    )

    out = Path(args.output)
    reason = _check_writable(out, args.force, TRANSFORMERS_MARKER)
    if reason:
        return _fail(reason)
    if args.from_json:
        return _rewrite_from_json(Path(args.from_json), out, transformers_markdown)
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        from tflms.trace.transformers import INSTALL_HINT

        return _fail(f"keras-hub is not installed: `make install` adds it, or {INSTALL_HINT}")

    def save(res: dict[str, Any]) -> None:
        # Written after every point, so a long run that is stopped keeps what it found.
        if args.json_output:
            Path(args.json_output).write_text(json.dumps(res, indent=2), encoding="utf-8")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(transformers_markdown(res), encoding="utf-8")

    res = run_transformers(
        progress=not args.no_progress and sys.stderr.isatty(), save=save, quick=args.quick
    )
    print(f"wrote {out} ({res['seconds'] / 60:.1f} min)")
    return 0


def _page_run(args: argparse.Namespace, marker: str, render: Any) -> tuple[Path, int | None]:
    """The page a long run writes, and None to go on running, or the exit code: refused (a
    file it did not write, no engine), or rewritten from --from-json without running."""
    out = Path(args.output)
    reason = _check_writable(out, args.force, marker)
    if reason:
        return out, _fail(reason)
    if args.from_json:
        return out, _rewrite_from_json(Path(args.from_json), out, render)
    reason = _engine_ready()
    return out, (_fail(reason) if reason else None)


def _write_page(out: Path, text: str, json_output: str | None, data: Any) -> None:
    if json_output:
        Path(json_output).write_text(json.dumps(data, indent=2), encoding="utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")


def cmd_steadiness(args: argparse.Namespace) -> int:
    import os

    from tflms.planner import steadiness
    from tflms.planner.simulate import progress_bar

    out, done = _page_run(
        args, steadiness.STEADINESS_MARKER, lambda d: steadiness.markdown(steadiness.from_json(d))
    )
    if done is not None:
        return done
    try:
        saved = json.loads(Path(args.results).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return _fail(f"cannot read the saved results {args.results}: {exc} (`make results`)")
    points = steadiness.points_of(saved)
    if args.only:
        points = [p for p in points if args.only in p.label()]
    if not points:
        return _fail(f"no point of {args.results} matches --only {args.only!r}")
    if args.jobs < 0:
        return _fail("--jobs must be 0 (one per CPU core) or more")
    jobs = args.jobs or os.cpu_count() or 1
    bar = progress_bar(
        "steadiness", len(points), not args.no_progress and sys.stderr.isatty(), "point"
    )
    try:
        measured = list(steadiness.measure(points, jobs, lambda p: bar.update(1)))
    finally:
        bar.close()
    # The page is rendered from what the JSON keeps (steps rounded to 10 us), so that
    # --from-json rebuilds it to the byte.
    data = steadiness.to_json(measured)
    _write_page(out, steadiness.markdown(steadiness.from_json(data)), args.json_output, data)
    print(f"wrote {out} ({len(measured)} points)")
    return 0


def cmd_lookahead(args: argparse.Namespace) -> int:
    import os

    from tflms.planner import lookahead_sweep as ls
    from tflms.planner.lookahead import DEFAULT_LOOKAHEAD, parse_lookaheads
    from tflms.planner.simulate import progress_bar

    out, done = _page_run(args, ls.LOOKAHEAD_MARKER, lambda d: ls.markdown(ls.from_json(d)))
    if done is not None:
        return done
    try:
        lookaheads = parse_lookaheads(args.lookaheads)
    except ValueError as exc:
        return _fail(str(exc))
    if args.jobs < 0:
        return _fail("--jobs must be 0 (one per CPU core) or more")
    try:
        saved = json.loads(Path(args.steadiness).read_text(encoding="utf-8"))
        entries = ls.entries_of(saved, args.only)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _fail(
            f"cannot read the saved steadiness {args.steadiness}: {exc} (`make steadiness`)"
        )
    if not entries:
        return _fail(f"no point of {args.steadiness} matches --only {args.only!r}")
    replays = len(entries) * len([v for v in lookaheads if v != DEFAULT_LOOKAHEAD])
    bar = progress_bar("lookahead", replays, not args.no_progress and sys.stderr.isatty(), "replay")
    jobs = args.jobs or os.cpu_count() or 1
    try:
        swept = list(ls.sweep(entries, lookaheads, jobs, lambda: bar.update(1)))
    finally:
        bar.close()
    data = ls.to_json(swept)  # rendered from what the JSON keeps, as cmd_steadiness does
    _write_page(out, ls.markdown(ls.from_json(data)), args.json_output, data)
    print(f"wrote {out} ({len(swept)} points)")
    return 0
