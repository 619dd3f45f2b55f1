"""The TFLMS papers' published rows, next to what the planner predicts on the same machine.

The anchors (reference/prior-art.md) were measured on V100s; the TFLMS work ran on
IBM's AC922 (V100 16 GB on NVLink 2 to POWER9), which is the `ac922-v100` pairing.
The published figures are gains (batch or resolution with LMS over without); the
planner gives the same ratios for its own models, and the predicted step-time cost
at those points, which the papers report only as "tuned" or not at all for V100.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tflms.planner.machines import get_pairing
from tflms.planner.replay import StepPlan, build_plan, replay, replay_unlimited
from tflms.planner.simulate import (
    SIZE_STEP,
    Machine,
    lms_json,
    max_batch,
    max_size,
)

if TYPE_CHECKING:
    from tflms.trace.format import Trace

PAPER_PAIRING = "ac922-v100"


@dataclasses.dataclass(frozen=True)
class PaperRow:
    source: str
    setting: str
    model: str
    published: str  # the claim, as published
    gain: float | None  # the published gain as a number (batch or voxel ratio), if any
    kind: str  # "batch", "voxels" or "fits" (a configuration that trains)
    batch: int = 0  # for "fits": the batch
    size: int = 0  # for "fits": the cube edge


PAPER_ROWS = (
    PaperRow(
        "TFLMS (ISMM 2019)", "V100 16 GB", "ResNet50", "4.9x batch", 4.9, "batch"
    ),
    PaperRow(
        "IBM, large data-flow graphs (2019)", "V100", "ResNet50", "more than 7x batch", 7.0,
        "batch",
    ),
    PaperRow(
        "TFLMS (ISMM 2019)", "V100 16 GB", "UNet3D", "5.6x resolution (taken as voxels)", 5.6,
        "voxels",
    ),
    PaperRow(
        "IBM, large data-flow graphs (2019)", "V100", "UNet3D", "192^3 at batch 4 trains", None,
        "fits", batch=4, size=192,
    ),
)  # fmt: skip

# The 3D U-Net rows again with the model closer in width to the papers' BraTS network
# (tflms/trace/models.py: 4 input channels, 16 base filters, 5 levels).
PAPER_UNET_MODELS = ("UNet3D", "UNet3DBraTS")
PAPER_ROWS = PAPER_ROWS + tuple(
    dataclasses.replace(r, model=model)
    for model in PAPER_UNET_MODELS[1:]
    for r in PAPER_ROWS
    if r.model == "UNet3D"
)

GetTrace = Callable[[str, int, "int | None"], "Trace"]


def largest_op_bytes(plan: StepPlan) -> int:
    """The most bytes one op pins at once (its inputs and new outputs).

    No scheme that swaps whole tensors, without splitting an op, runs a step whose
    largest op needs more than the GPU's memory.
    """
    return max(
        (
            sum(plan.sizes[t] for t in ins) + sum(b for _, b in outs)
            for ins, outs in zip(plan.inputs, plan.outputs, strict=True)
        ),
        default=0,
    )


def _step_cost(trace: Trace, machine: Machine, steps: int) -> dict[str, Any]:
    """On-demand (prefetch off) and prefetch (the patch's default) step cost of `trace`."""
    plan = build_plan(trace, machine.gpu)
    largest = largest_op_bytes(plan)
    unlimited = replay_unlimited(plan, machine.gpu, machine.link_gbps, steps=steps)
    out: dict[str, Any] = {"unlimited_step_time_s": unlimited.step_time_s}
    out["largest_op_bytes"] = largest
    out["without_lms_fits"] = replay(plan, machine.gpu, machine.config(lms=False), steps=1).fits
    for key, prefetch in (("on_demand", False), ("prefetch", True)):
        r = replay(plan, machine.gpu, machine.config(prefetch=prefetch), steps=steps, timed=True)
        out[key] = lms_json(r, unlimited.step_time_s, plan)
    return out


def run_paper_comparison(
    get_trace: GetTrace,
    *,
    steps: int = 2,
    progress: bool = False,
    studies: list[dict[str, Any]] | None = None,
    machine: Machine | None = None,
) -> dict[str, Any]:
    """Each published row with the planner's figure on the paper's machine.

    studies: results already computed (`tflms results`) whose searches are reused.
    machine: another machine than the AC922 (tests).
    """
    machine = machine or Machine.from_pairing(get_pairing(PAPER_PAIRING))
    known = {
        s["model"]: s
        for s in studies or []
        if s["machine"].get("pairing") == machine.pairing and not s["machine"].get("what_if")
    }
    resnet = known.get("ResNet50", {}).get("max_batch")
    if resnet is None:
        from tflms.planner.study import exact_pairings

        # As ResNet50's study searches it: exactly where its StudyModel says so.
        exact = machine.pairing in exact_pairings("ResNet50")
        resnet = max_batch(
            get_trace("ResNet50", 32, None), machine, steps=steps, rel_tol=0.0 if exact else 0.01
        )
    sizes: dict[str, dict[str, Any]] = {}

    def size_search(model: str) -> dict[str, Any]:
        if model not in sizes:
            found = known.get(model, {}).get("max_size")
            sizes[model] = found or max_size(
                lambda size: get_trace(model, 1, size), machine, start_size=64, steps=steps
            )
        return sizes[model]

    rows = []
    for row in PAPER_ROWS:
        out: dict[str, Any] = dataclasses.asdict(row)
        if row.kind == "batch":
            base = resnet["without_lms"]
            out["planner_gain"] = resnet["ratio"]
            out["planner"] = f"{resnet['with_lms']} / {base}"
            target = max(base + 1, round(row.gain * base)) if row.gain else 0
            out["at_published_gain"] = {"batch": target, "fits": target <= resnet["with_lms"]}
            if target <= resnet["with_lms"]:
                trace = get_trace("ResNet50", 32, None).rescaled(target)
                out["at_published_gain"].update(_step_cost(trace, machine, steps))
        elif row.kind == "voxels":
            unet = size_search(row.model)
            out["planner_gain"] = unet["voxel_ratio"]
            out["planner"] = f"{unet['with_lms']}^3 / {unet['without_lms']}^3"
            if row.gain and unet["without_lms"]:
                edge = unet["without_lms"] * row.gain ** (1 / 3)
                size = max(SIZE_STEP, int(edge // SIZE_STEP) * SIZE_STEP)
                out["at_published_gain"] = {"size": size, "fits": size <= unet["with_lms"]}
                trace = get_trace(row.model, 1, size)
                if size <= unet["with_lms"]:
                    out["at_published_gain"].update(_step_cost(trace, machine, steps))
                else:
                    plan = build_plan(trace, machine.gpu)
                    out["at_published_gain"]["largest_op_bytes"] = largest_op_bytes(plan)
        else:
            trace = get_trace(row.model, 1, row.size).rescaled(row.batch)
            cost = _step_cost(trace, machine, steps)
            out["planner"] = "trains" if cost["on_demand"]["fits"] else "does not fit"
            out["planner_gain"] = None
            out["at_published_gain"] = {"batch": row.batch, "size": row.size, **cost}
            out["at_published_gain"]["fits"] = cost["on_demand"]["fits"]
        rows.append(out)
    return {
        "machine": machine.to_json(),
        "resnet50": resnet,
        "unet3d": sizes.get("UNet3D"),
        "size_searches": sizes,
        "rows": rows,
    }
