"""`make soak`: a million (by default) random engine operations against the reference model.

Prints progress and a summary; exits non-zero on any corruption or broken invariant.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from tqdm import tqdm

import tflms
from tests.engine_model import ModelRun


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device-kib", type=int, default=512)
    args = parser.parse_args(argv)
    eng = tflms.Engine(
        device_memory=args.device_kib * 1024,
        host_memory=1 << 30,
        defrag=True,
        prefetch=True,
        verify_moves=True,
        verify_pins=True,
    )
    run = ModelRun(eng, random.Random(args.seed), max_size=96 * 1024, device=args.device_kib * 1024)
    start = time.monotonic()
    for i in tqdm(range(args.ops), desc="soak", unit="op", mininterval=1.0):
        run.step()
        if i % 10_000 == 0:
            eng.check_invariants()
        if len(run.live) > 200:  # keep the working set around 10x the device
            run.free(next(iter(run.live)))
    run.finish()
    eng.check_invariants()
    s = eng.stats()
    print(
        f"{run.ops} ops in {time.monotonic() - start:.0f} s: corruptions={run.corruptions} "
        f"ooms={run.ooms} reclaimed={s['bytes_reclaimed'] / 2**30:.2f} GiB "
        f"page_ins={s['num_page_ins']} defragged={s['bytes_defragged'] / 2**20:.1f} MiB "
        f"prefetch_hits={s['prefetch_hits']}"
    )
    return 1 if run.corruptions else 0


if __name__ == "__main__":
    sys.exit(main())
