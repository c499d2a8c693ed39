"""Plan several rows of bench/gpu_truth.py in one process: ``python bench/gpu_truth_plan.py <jobs.json>``.

Why not one ``python -m runner ... mode=plan`` each: on a 2-core CI machine the interpreter start and
the imports of torch, diffusers and Hydra are most of a tiny plan's ~13 s, and the dry run plans ten
rows. Each job here is exactly what that command does (the runner's own task on the composed
config, as bench/oom_gpu.py runs it, and as ``python -m runner -m`` runs the jobs of a sweep one after
another in one process), so plan.json is the same file. ``jobs.json`` holds ``[name, overrides,
folder]`` triples; each job leaves ``plan.json`` (when the planner got that far: a plan over budget is
written before it is refused) and ``plan_result.json`` (exit status as the command line would give
it, the error's first line, seconds) in its folder, so a worker killed by the budget loses only the
jobs it had not finished.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(spec: Path) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # as runner/__main__.py does
    from runner.__main__ import task
    from runner.cli.compose import compose_config

    for name, overrides, folder in json.loads(spec.read_text()):
        started = time.monotonic()
        rc, error = 0, None
        try:
            task(compose_config([*overrides, "mode=plan", f"output_dir={folder}"]))
        except Exception as e:  # noqa: BLE001 - recorded per job (UserError carries the command line's exit status)
            rc, error = int(getattr(e, "exit_code", 1)), f"{type(e).__name__}: {str(e).strip()}"
            print(f"{name}: {error}", file=sys.stderr, flush=True)
        result = {"name": name, "rc": rc, "error": error, "seconds": round(time.monotonic() - started, 2)}
        (Path(folder) / "plan_result.json").write_text(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
