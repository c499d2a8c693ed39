"""The processes of bench/gpu_truth.py: each run in its own process group, killed whole at its timeout,
and the machine as torch sees it (asked in a child, so that the script never holds a CUDA context).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gpu_truth_rows import ROOT

PROBE = ("import importlib.util, json, torch\n"
         "d = {'torch': torch.__version__, 'cuda_version': torch.version.cuda, 'cuda': torch.cuda.is_available()}\n"
         "d['runner_plugins'] = importlib.util.find_spec('runner.plugins') is not None\n"
         "if d['cuda']:\n"
         "    p = torch.cuda.get_device_properties(0)\n"
         "    d.update(name=p.name, total_bytes=p.total_memory, count=torch.cuda.device_count())\n"
         "print(json.dumps(d))\n")
LIVE: set[subprocess.Popen] = set()  # children still running: killed if this script is stopped
LIVE_LOCK = threading.Lock()


def run_command(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> int | None:
    """Run ``cmd`` in its own process group, output to ``log``; its exit status, or None when it was
    killed at ``timeout_s`` (the whole group: the runner's own children too)."""
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with LIVE_LOCK:
            LIVE.add(proc)
        try:
            return proc.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill(proc)


def kill(proc: subprocess.Popen) -> None:
    with LIVE_LOCK:
        LIVE.discard(proc)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we started (start_new_session); gone already is fine
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def kill_all() -> None:
    with LIVE_LOCK:
        procs = list(LIVE)
    for proc in procs:
        kill(proc)


def probe(dry: bool) -> dict[str, Any]:
    """torch's view of the machine, asked in a child process: this one never initialises CUDA, so no
    context of ours sits on the card the runs measure."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"bench/gpu_truth.py: {sys.executable} cannot import torch: "
                         f"{last_line(proc.stderr) or 'exit ' + str(proc.returncode)}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    if not info["runner_plugins"]:  # plugins/ ships as runner.plugins: a checkout that was never installed lacks it
        print("bench/gpu_truth.py: runner.plugins is not importable from this checkout (it is installed as "
              "runner/plugins); install it (make setup, or pip install -e .) or, where nothing can be installed, "
              "link it: ln -sfn ../plugins runner/plugins", file=sys.stderr)
        raise SystemExit(2)
    if not dry and not info["cuda"]:
        print(f"bench/gpu_truth.py: no CUDA device (torch {info['torch']}: torch.cuda.is_available() is False); "
              "it measures GPU memory and needs one. On a CPU, --dry-run checks the script.", file=sys.stderr)
        raise SystemExit(2)
    info["driver"] = nvidia_driver() if not dry else None
    return info


def last_line(text: str) -> str | None:
    lines = [t for t in text.splitlines() if t.strip()]
    return lines[-1].strip() if lines else None


def nvidia_driver() -> str:
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (nvidia-smi failed)"
    return (out.strip().splitlines() or ["unknown"])[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


