"""The TFLMS v1 parameters and what each one means for allocator LMS.

TFLMS v1 rewrote the graph: it chose tensors to swap by walking it (from
optimizer scopes, starting scopes or op names, filtered by scope and type) and
inserted swap-out/swap-in ops placed by `lb`/`ub`. Allocator LMS needs none of
that: the GPU allocator moves whichever tensors no running op uses when an
allocation does not fit. So most v1 parameters have no meaning any more; the
few that do are turned into settings of the patched TensorFlow here.

This module does not import TensorFlow: the translation is plain data, applied
by runtime.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Setter names in tf.config.experimental. Settings are applied in this order
# (switching LMS on or off first, so a refusal stops before anything else).
SET_ENABLED = "set_lms_enabled"
SET_PREFETCH_ENABLED = "set_lms_prefetch_enabled"
SET_PREFETCH_LOOKAHEAD = "set_lms_prefetch_lookahead"
SETTER_ORDER: tuple[str, ...] = (SET_ENABLED, SET_PREFETCH_ENABLED, SET_PREFETCH_LOOKAHEAD)

_NO_GRAPH_WALK = (
    "allocator LMS does not walk the graph: every GPU tensor that no running op uses is a "
    "candidate, so it needs no place to start from"
)
_NO_FILTER = (
    "the allocator does not see op scopes or types: what is moved follows from use (the least "
    "recently used tensors that no running op needs)"
)


@dataclass(frozen=True)
class V1Parameter:
    name: str
    default: object
    # What the parameter does in allocator LMS, or why it does nothing.
    now: str
    # True when it still has an effect (never part of the "no meaning" warning).
    mapped: bool = False


# Every parameter of TFLMS v1's LMS / LMSSessionRunHook / LMSKerasCallback, with
# its v1 default (empty sets are frozensets here: the same value, immutable).
PARAMETERS: tuple[V1Parameter, ...] = (
    V1Parameter(
        "optimizer_scopes",
        frozenset(),
        "allocator LMS needs no optimizer scopes: it sees every tensor when it is allocated "
        "and used, so it does not need to know where the backward pass starts",
    ),
    V1Parameter(
        "graph",
        None,
        "accepted and not needed: the setting applies to the whole process",
        mapped=True,
    ),
    V1Parameter("starting_scope", None, _NO_GRAPH_WALK),
    V1Parameter("starting_op_names", None, _NO_GRAPH_WALK),
    V1Parameter("excl_scopes", frozenset(), _NO_FILTER),
    V1Parameter("incl_scopes", frozenset(), _NO_FILTER),
    V1Parameter("excl_types", frozenset(), _NO_FILTER),
    V1Parameter("incl_types", frozenset(), _NO_FILTER),
    V1Parameter(
        "n_tensors",
        -1,
        "0 switches LMS off, -1 (or any negative) switches it on; the allocator does not count "
        "tensors, so a positive count means on, with its number ignored",
        mapped=True,
    ),
    V1Parameter(
        "lb",
        1,
        "switches prefetch on and becomes its lookahead: how many tensor uses ahead the "
        "allocator starts bringing tensors back (0: prefetch explicitly off, on demand, "
        "whatever TensorFlow's default is)",
        mapped=True,
    ),
    V1Parameter(
        "ub",
        10000,
        "caps the prefetch lookahead; on its own it switches prefetch on with that lookahead",
        mapped=True,
    ),
    V1Parameter(
        "fuse_swapins",
        False,
        "there are no swap-in ops to fuse: the allocator copies each tensor back itself",
    ),
    V1Parameter(
        "ctrld_strategy",
        "chain_rule",
        "there are no control dependencies to place: a tensor comes back when an op that needs "
        "it is about to run",
    ),
    V1Parameter(
        "swap_branches",
        False,
        "branches need no special case: a tensor that a branch holds on to is moved like any "
        "other tensor that no running op uses",
    ),
    V1Parameter(
        "branch_threshold",
        0,
        "branches need no special case, so there is no distance threshold for them",
    ),
    V1Parameter(
        "debug",
        False,
        "logs LMS statistics (tf.experimental.get_lms_stats) to the "
        "'tensorflow_large_model_support' logger",
        mapped=True,
    ),
    V1Parameter(
        "debug_level",
        1,
        "1: statistics per epoch / at the end; 2: also per step",
        mapped=True,
    ),
    V1Parameter(
        "cpu_device",
        "/cpu:0",
        "moved tensors go to pinned host memory of the GPU's own NUMA node, sized by "
        "TF_GPU_HOST_MEM_LIMIT_IN_MB",
    ),
    V1Parameter(
        "optimizer_scopes_override",
        None,
        "allocator LMS needs no optimizer scopes (LMSKerasCallback found them in the Keras "
        "model to start its graph walk)",
    ),
)

BY_NAME: dict[str, V1Parameter] = {p.name: p for p in PARAMETERS}


@dataclass
class Translation:
    """What a set of v1 parameters asks of allocator LMS."""

    # tf.config.experimental setter name -> value, in SETTER_ORDER.
    settings: dict[str, object] = field(default_factory=dict)
    # Setter name -> the v1 parameters it comes from (for messages).
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # v1 parameter given a non-default value that has no effect -> why.
    ignored: dict[str, str] = field(default_factory=dict)
    debug: bool = False
    debug_level: int = 1

    @property
    def enabled(self) -> bool:
        return bool(self.settings.get(SET_ENABLED, False))

    def ignored_message(self, caller: str) -> str:
        lines = [
            f"{caller}: these TFLMS v1 parameters have no effect with allocator Large Model "
            f"Support and are ignored:"
        ]
        lines += [f"  {name}: {why}." for name, why in self.ignored.items()]
        lines.append("See docs/migration.md for what each v1 parameter means now.")
        return "\n".join(lines)


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int (a number of ops), got {value!r}")
    return value


def _differs(name: str, value: object) -> bool:
    default = BY_NAME[name].default
    if isinstance(default, frozenset):
        # v1 users passed sets, lists or tuples of names; empty means "not given".
        return bool(value)
    return bool(value != default)


# The engine's lookahead is an int32 (GPUOptions.experimental.lms_prefetch_lookahead).
MAX_LOOKAHEAD = 2**31 - 1


def prefetch_lookahead(lb: int, ub: int) -> tuple[int, tuple[str, ...]]:
    """The prefetch lookahead (in tensor uses) that v1's lb/ub ask for, and its sources.

    v1 placed a tensor's swap-in between `lb` and `ub` ops before the op that
    uses it, as close to `lb` as the graph allowed. The allocator starts
    bringing a tensor back once its next use is within the lookahead (and the
    prefetch byte budget allows), so the lookahead takes the distance v1 aimed
    for, `lb`, with `ub` as its cap. Given on its own, `ub` (with lb at its
    default of 1, which only means "as late as possible") is the lookahead. With
    both at their v1 defaults nothing is asked (sources are empty): prefetch
    keeps TensorFlow's setting (unset: LMS's default, off in this release) and
    its default lookahead (128).
    """
    if _differs("lb", lb):
        return min(lb, MAX_LOOKAHEAD), (("lb", "ub") if _differs("ub", ub) else ("lb",))
    if _differs("ub", ub):
        return min(ub, MAX_LOOKAHEAD), ("ub",)
    return 0, ()


def translate(values: Mapping[str, object]) -> Translation:
    """Turns v1 keyword values into allocator LMS settings.

    Raises ValueError for values v1 also rejected or that contradict each other.
    """
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unknown TFLMS v1 parameter(s): {', '.join(unknown)}")
    result = Translation()

    n_tensors = values.get("n_tensors", -1)
    if isinstance(n_tensors, bool) or not isinstance(n_tensors, int):
        raise ValueError(f"n_tensors must be an int (0 = LMS off, -1 = all), got {n_tensors!r}")
    result.settings[SET_ENABLED] = n_tensors != 0
    result.sources[SET_ENABLED] = ("n_tensors",)
    if n_tensors > 0:
        result.ignored["n_tensors"] = (
            f"LMS is on; the allocator does not count tensors, so the count {n_tensors} is "
            f"ignored (n_tensors=0 switches LMS off)"
        )

    lb = _non_negative_int("lb", values.get("lb", 1))
    ub = _non_negative_int("ub", values.get("ub", 10000))
    if lb > ub:
        raise ValueError(f"lb ({lb}) must not be greater than ub ({ub})")
    if result.enabled:
        lookahead, sources = prefetch_lookahead(lb, ub)
        if sources:
            # 0 asks for swap-ins right before use: on-demand paging, no prefetch. An
            # explicit False (not "leave the default"), so it holds if the default is on.
            result.settings[SET_PREFETCH_ENABLED] = lookahead > 0
            result.sources[SET_PREFETCH_ENABLED] = sources
            if lookahead > 0:
                result.settings[SET_PREFETCH_LOOKAHEAD] = lookahead
                result.sources[SET_PREFETCH_LOOKAHEAD] = sources

    debug = values.get("debug", False)
    result.debug = bool(debug)
    debug_level = values.get("debug_level", 1)
    if isinstance(debug_level, bool) or not isinstance(debug_level, int) or debug_level < 1:
        raise ValueError(f"debug_level must be 1 or 2, got {debug_level!r}")
    result.debug_level = debug_level

    for parameter in PARAMETERS:
        if parameter.mapped or parameter.name not in values:
            continue
        if _differs(parameter.name, values[parameter.name]):
            result.ignored[parameter.name] = parameter.now
    # Keep the setter order stable whatever order the rules above ran in.
    result.settings = {k: result.settings[k] for k in SETTER_ORDER if k in result.settings}
    return result
