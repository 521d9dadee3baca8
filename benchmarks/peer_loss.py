"""How fast the surviving rank learns that its peer died: repeated runs of the fault
tests' scenarios (``tests/fsdp/fault_cases.py``: 2 gloo ranks, 10 s collective timeout,
rank 1 fails at step 1), every second run with the machine loaded by processes that
compile with Inductor in a loop.

Prints one JSON line per run (rank 0's outcome, and ``in_step_s``: seconds from the
start of the step in which its peer died to its error) and a summary per scenario and
load, and writes every run with the checkout's commit and date as JSON (default
``benchmarks/out/peer_loss.json``). A scenario is ``mode:where:kind`` as in
``tests/fsdp/test_faults.py``; mode ``fsdp2`` runs torch's FSDP2 (eager) instead of ours.

Run from the repository root:
``python benchmarks/peer_loss.py --runs 20 eager:block1:exit eager:block0:exit
eager:block1_backward:exit compile:block1:exit``.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_traceable.cli.bench_output import (  # noqa: E402  (after the path)
    add_output_arguments,
    output_path,
    provenance,
)
from tests.fsdp.test_faults import run_scenario  # noqa: E402

# One loading process: compiles a small function with Inductor, again and again.
LOAD = """
import sys, time, torch
torch.set_num_threads(1)
end, i = time.time() + float(sys.argv[1]), 0
while time.time() < end:
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() @ x.cos()).relu().sum() * (i + 1))
    f(torch.randn(64 + i % 7, 64 + i % 7))
    i += 1
"""


def _run(scenario: str, loaders: int) -> dict:
    mode, where, kind = scenario.split(":")
    load = [subprocess.Popen([sys.executable, "-c", LOAD, "600"]) for _ in range(loaders)]
    try:
        if load:
            time.sleep(3)  # the loaders are compiling before the ranks start
        with tempfile.TemporaryDirectory() as out_dir:
            started = time.monotonic()
            survivor, _ = run_scenario(mode, where, kind, out_dir)
            wall = time.monotonic() - started
    finally:
        for process in load:
            process.kill()
            process.wait()
    return {
        "scenario": scenario, "loaded": bool(loaders), "wall_s": round(wall, 2),
        "hung": survivor["hung"], "status": survivor.get("status"),
        "steps_done": survivor.get("steps_done"),
        "in_step_s": round(survivor.get("seconds_in_failed_step", float("nan")), 3),
        "message": (survivor.get("message") or "")[:200],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="+", help="mode:where:kind")
    parser.add_argument("--runs", type=int, default=20, help="runs per scenario")
    parser.add_argument("--loaders", type=int, default=2,
                        help="compiling processes in every second run")
    add_output_arguments(parser, "peer_loss.json")
    args = parser.parse_args()
    summary: dict[tuple[str, bool], list[dict]] = collections.defaultdict(list)
    for scenario in args.scenarios:
        for run in range(args.runs):
            result = _run(scenario, args.loaders if run % 2 else 0)
            print(json.dumps(result), flush=True)
            summary[(scenario, result["loaded"])].append(result)
    for (scenario, loaded), results in summary.items():
        raised = sum(r["status"] == "raised" for r in results)
        hung = sum(r["hung"] for r in results)
        worst = max(r["in_step_s"] for r in results)
        print(f"{scenario} loaded={loaded}: {len(results)} runs, rank 0 raised in {raised}, "
              f"hung in {hung}, at most {worst:.2f} s into the step")
    out = output_path(args.out, args.publish, "peer_loss.json", ROOT)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [result for results in summary.values() for result in results]
    out.write_text(json.dumps({"provenance": provenance(ROOT), "loaders": args.loaders,
                               "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
