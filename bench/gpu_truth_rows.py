"""The rows of bench/gpu_truth.py: what each one runs, and what is read back from its files.

Kept apart from the script so that the CI test can check the pieces that need no run (the card's
conf/devices.yaml key, the override merging) and so that the script stays short. Only the
runner's output files are read (plan.json, metrics.jsonl, job_summary.json): they are what a user
sees, and they do not move when the runner's modules are reorganised.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # the GPU runs that came back (a folder per lent card and date)
GIB = 2**30


@dataclass
class Row:
    """One measured run. ``settings`` are its overrides beyond the preset and the common ones."""

    name: str  # also the folder name: letters, digits and '_' only (the device tool's $OUT rule)
    preset: str
    settings: list[str] = field(default_factory=list)
    kind: str = "preset"  # preset | stream | fused | oom | compile
    baseline: str | None = None  # the row it is compared with
    why: str = ""
    needs_cuda: str | None = None  # why it cannot run in the CPU dry run
    dry_settings: list[str] = field(default_factory=list)  # added in the dry run only (after settings)


def shipped_presets() -> list[str]:
    """Every preset the project ships: one row each."""
    return sorted(p.stem for p in (ROOT / "conf" / "preset").glob("*.yaml"))


def extra_rows(presets: list[str]) -> list[Row]:
    """The three comparisons of issue 33, each on a shipped preset, with why that preset.

    Each variant is compared with its preset's own row (run as shipped), so a comparison costs one
    run, not two. An extra whose preset is no longer shipped is left out, not guessed.
    """
    rows = [
        Row("sd35_24gb__stream", "sd35_24gb", ["offload=[park,stream]"], "stream", "sd35_24gb",
            "offload=stream on vs off on a DiT: SD3.5 Large LoRA keeps its 8.1 B bf16 base on the device as shipped; "
            "with offload=[park,stream] half of the base's block weights live in pinned host memory (the default "
            "device_fraction). Both plan inside 24 GiB, and a LoRA checkpoint is small. flux_24gb_full cannot run "
            "without stream at any resolution (its 12 B float32 weights alone are 48 GB), and a second run of it "
            "(the 12 B float32 build, ~40 GB pinned, copy-bound steps) would take much of the budget.",
            # the tiny model has 2 blocks: with prefetch 1 the window is every block and nothing can stream
            dry_settings=["offload.stream.device_fraction=0.9", "offload.stream.prefetch=0"]),
        Row("sdxl_24gb__fused_backward", "sdxl_24gb", ["optimizer.fused_backward=true"], "fused", "sdxl_24gb",
            "fused backward on the SDXL full fine-tune, against the preset's own row: the planned saving is the "
            "gradients alive at the normal step's peak (bench/fused_backward.py). Clipping stays on as shipped, "
            "so fused backward clips per parameter; peak and time are what is compared."),
        Row("sdxl_24gb__fused_noclip", "sdxl_24gb", ["optimizer.fused_backward=true", "train.max_grad_norm=0"], "fused",
            "sdxl_24gb", "fused backward without clipping (each parameter's hook checks finiteness instead of clipping): "
            "mode=fit at budget_gb=12 ranks this ahead of stream offload by the model's price of the clip's kernels, "
            "which only the clipped row above measured (issue 41)"),
        Row("sd15_8gb__oom_recovery", "sd15_8gb", ["checkpoint=[]", "train.batch_size=8", "train.grad_accum=1",
                                                   "data.demo_size=8"], "oom", None,
            "an injected CUDA OOM, recovered: SD1.5 at batch 8 without checkpointing, so that micro-batch 8 and "
            "micro-batch 4 plan gigabytes apart (their plans are in the comparison), capped halfway between the two "
            "(the runner's preflight would refuse a cap below the plan; it is off for every row, whose plan is made "
            "beforehand). Ok when the run ends ok with a smaller micro-batch after an OOM retry.",
            needs_cuda="the cap is torch.cuda.set_per_process_memory_fraction"),
        *(Row(f"{p}__compile", p, ["train.compile=true"], "compile", p,
              f"regional torch.compile on {p} against its eager row: s/step, card ops and memory (issue 41); the "
              "compile time is paid in step 1, which is not timed",
              needs_cuda="inductor compiles the full-size blocks for the card; on the CPU dry run it would compile "
                         "C++ kernels for minutes")
          for p in ("sdxl_24gb", "flux_24gb")),
    ]
    return [r for r in rows if r.preset in presets]


def all_rows() -> list[Row]:
    presets = shipped_presets()
    return [Row(p, p) for p in presets] + extra_rows(presets)


def merge_overrides(*groups: list[str]) -> list[str]:
    """The overrides of ``groups`` in order, a later ``key=value`` replacing an earlier one of the same key
    (Hydra refuses a key given twice on one command line)."""
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            merged[item.split("=", 1)[0]] = item
    return list(merged.values())


# ---- the card ------------------------------------------------------------------------------------
# torch.cuda.get_device_name() patterns -> conf/devices.yaml keys. Where one pattern fits several keys
# (A100 40/80 GB), the memory decides; every match is also checked against the key's memory_gib, so
# an H100 NVL (94 GB) or a 16 GB variant of a 24 GB card is "unknown", not mislabelled.
NAME_PATTERNS = [
    (r"H200", ["h200"]),
    (r"H100.*PCIe", ["h100_pcie"]),
    (r"H100", ["h100_sxm"]),
    (r"A100", ["a100_80gb", "a100_40gb"]),
    (r"L40S", ["l40s"]),
    (r"RTX 6000 Ada", ["rtx6000_ada"]),
    (r"RTX A6000", ["a6000"]),
    (r"RTX 4090(?! ?D)", ["rtx4090"]),
    (r"RTX 4080(?! ?SUPER)", ["rtx4080"]),
    (r"RTX 3090(?! ?Ti)", ["rtx3090"]),
    (r"RTX 3060", ["rtx3060_12gb"]),
]
MEMORY_TOLERANCE = 0.05  # torch's total_memory against the table's memory_gib (drivers reserve a little)


def device_table() -> dict[str, dict[str, Any]]:
    import yaml  # the runner's own dependency (its configs are YAML)

    return dict(yaml.safe_load((ROOT / "conf" / "devices.yaml").read_text())["devices"])


def device_key(name: str, total_bytes: int, table: dict[str, dict[str, Any]]) -> tuple[str | None, str]:
    """The conf/devices.yaml key of the card torch reports, and a sentence saying how (or why none)."""
    gib = total_bytes / GIB
    for pattern, keys in NAME_PATTERNS:
        if not re.search(pattern, name):
            continue
        known = [k for k in keys if k in table]
        if not known:
            break
        key = min(known, key=lambda k: abs(float(table[k]["memory_gib"]) - gib))
        want = float(table[key]["memory_gib"])
        if abs(want - gib) > MEMORY_TOLERANCE * want:
            return None, (f"{name} with {gib:.1f} GiB is not the card of conf/devices.yaml's {key} ({want:g} GiB): "
                          "no predicted s/step for it")
        return key, f"{name} ({gib:.1f} GiB) is conf/devices.yaml's {key}"
    return None, f"{name} has no entry in conf/devices.yaml: no predicted s/step for it (--device-name KEY names one)"


# ---- reading a row's files -----------------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by a kill: the others still count
            continue
    return out


def plan_figures(plan: dict[str, Any] | None) -> dict[str, Any]:
    """What the table needs of a plan.json (None values when there is no plan)."""
    if plan is None:
        return {"plan_peak_gb": None, "plan_required_gb": None, "plan_budget_gb": None, "plan_fits": None,
                "plan_phase": None, "predicted_s": None, "predicted_on": None, "plan_mfu": None}
    st = plan.get("step_time") or {}
    budget = plan.get("budget_bytes")
    return {"plan_peak_gb": plan["peak_bytes"] / GIB, "plan_required_gb": plan["required_bytes"] / GIB,
            "plan_budget_gb": None if budget is None else budget / GIB, "plan_fits": plan.get("fits"),
            "plan_phase": plan.get("peak_phase"), "predicted_s": st.get("seconds"), "predicted_on": st.get("device"),
            "plan_mfu": st.get("mfu")}


def first_line(text: str | None) -> str | None:
    lines = [t.strip() for t in (text or "").splitlines() if t.strip()]
    return lines[0][:300] if lines else None


def last_log_line(log: Path) -> str | None:
    try:
        lines = [t.strip() for t in log.read_text(errors="replace").splitlines() if t.strip()]
    except OSError:
        return None
    return lines[-1][:300] if lines else None


def measured(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-run figures from metrics.jsonl: CUDA peaks (null on CPU), s/step of steps 2.. (step 1 warms up:
    mean, and the spread (max - min) / median of those steps)."""
    def peak(key: str) -> float | None:
        vals = [s[key] for s in steps if s.get(key) is not None]
        return max(vals) if vals else None

    tail = [s["s_per_step"] for s in steps[1:] if s.get("s_per_step") is not None]
    return {"steps_done": len(steps), "alloc_peak_gb": peak("memory_peak_gb"),
            "reserved_peak_gb": peak("mem_peak_reserved_gb"), "s_per_step": sum(tail) / len(tail) if tail else None,
            "timed_steps": len(tail), "s_per_step_min": min(tail) if tail else None,
            "s_per_step_max": max(tail) if tail else None,
            "spread": (max(tail) - min(tail)) / sorted(tail)[len(tail) // 2] if len(tail) > 1 else None,
            "micro_batches": [s.get("micro_batch_size") for s in steps],
            "oom_retries": [s.get("oom_retries", 0) for s in steps]}


BLOCKED_SAVE = "Saving the checkpoint of step"  # the runner's StorageError, when the save was blocked on purpose


def read_row(row: Row, out: Path, log: Path, rc: int, steps: int, batch: int | None,
             save_blocked: bool = False) -> dict[str, Any]:
    """The row's record from its run folder: status, measured figures and the plan's.

    ``save_blocked``: the script put a file where the checkpoint folder goes, so the runner's final
    save stops at once (io_error, nothing written) after the measured steps; such a run is ok, and
    ``runner_status`` keeps what the runner said."""
    summary = read_json(out / "job_summary.json")
    rec: dict[str, Any] = {"row": row.name, "kind": row.kind, "preset": row.preset, "settings": row.settings,
                           "exit_code": rc, **plan_figures(read_json(out / "plan.json")),
                           **measured(read_jsonl(out / "metrics.jsonl"))}
    if summary is None:
        rec.update(status="failed", error=f"exit {rc}, no job_summary.json: {last_log_line(log) or 'no output'}")
    else:
        rec.update(status=summary.get("status", "failed"), error=first_line(summary.get("error")),
                   peak_gb=summary.get("peak_memory_gb"), peak_source=summary.get("peak_memory_source"))
    if (save_blocked and rec["status"] == "io_error" and rec["steps_done"] == steps
            and (rec["error"] or "").startswith(BLOCKED_SAVE)):
        rec.update(status="ok", runner_status="io_error: final checkpoint save blocked on purpose", error=None)
    if rec["status"] == "ok" and rec["steps_done"] < steps:
        rec.update(status="failed", error=f"ended ok after {rec['steps_done']} of {steps} steps")
    if row.kind == "oom" and rec["status"] == "ok":
        rec.update(oom_check(rec, batch))
    return rec


def oom_check(rec: dict[str, Any], batch: int | None) -> dict[str, Any]:
    """The injected-OOM row is ok only if the cap bit: an OOM retry, then a smaller micro-batch."""
    micros = [m for m in rec["micro_batches"] if m is not None]
    if sum(rec["oom_retries"]) < 1 or not micros or batch is None or min(micros) >= batch:
        return {"status": "failed", "error": f"the cap did not bite: micro-batches {micros}, OOM retries "
                                             f"{rec['oom_retries']} (batch {batch}); nothing was recovered"}
    return {}
