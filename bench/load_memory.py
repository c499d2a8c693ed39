"""Peak host RAM while loading a full-size SDXL single file (runner/families/common/single_file.py).

    python bench/load_memory.py            # fp16 file -> bfloat16, fp32 file -> bfloat16, fp16 file -> float16
    python bench/load_memory.py --write    # also replace this section of docs/benchmarks.md

The file is the full SDXL checkpoint in the A1111/ComfyUI layout (U-Net, VAE, CLIP-L, OpenCLIP
bigG: 3.5 B parameters), all zeros, written as a sparse file (the header, then a hole: no disk
space, written in milliseconds; tests/original_layouts.py). Each case runs in a fresh process:
the trainer is built (header read, layout recognised), the process's RSS is taken as the
baseline, then ``build_models("cpu")`` loads every module from the file in ``model.dtype``; a
thread samples ``/proc/self/status`` every 2 ms (anonymous and file-backed RSS) and the kernel's
own ``VmHWM`` (peak RSS) is read at the end. Reported: the modules' bytes in the target dtype,
the peak RSS above the baseline and their ratio, which the issue bounds at about 1.2.

Reading zeros from a hole costs no disk time but the same memory as real data: pages of the
mapped file are counted in RSS as they are read, and converted tensors are new anonymous memory.
Tensors already in the target dtype are not copied (views of the file's copy-on-write mapping),
so that case shows how little loading itself holds; their pages enter RSS when first used.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from docs_section import replace_section  # noqa: E402  (bench/ is on sys.path as the script's folder)

sys.path.append(str(ROOT / "tests"))  # tests/original_layouts.py writes the original layout (after ROOT: see there)

MARK_BEGIN = "<!-- bench/load_memory.py begin -->"
MARK_END = "<!-- bench/load_memory.py end -->"
CASES = [("float16", "bfloat16"), ("float32", "bfloat16"), ("float16", "float16")]

CHILD = r'''
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from runner.parts import build_trainer
from runner.cli.compose import compose_config

def status():
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024
    return out

trainer = build_trainer(compose_config(["trainer=sdxl", "model.size=full", "model.path=" + sys.argv[2],
                                        "model.dtype=" + sys.argv[3], "model.train=lora"]))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
base = status()
peak = {"anon": 0, "file": 0, "rss": 0}
stop = False
def sample():
    while not stop:
        s = status()
        peak["anon"] = max(peak["anon"], s["RssAnon"])
        peak["file"] = max(peak["file"], s["RssFile"])
        peak["rss"] = max(peak["rss"], s["VmRSS"])
        time.sleep(0.002)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
t0 = time.perf_counter()
models = trainer.build_models("cpu")
seconds = time.perf_counter() - t0
stop = True
thread.join()
end = status()
modules = [m for _, m in models.items()]
seen, model_bytes = set(), 0
for m in modules:
    for t in [*m.parameters(), *m.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            model_bytes += t.numel() * t.element_size()
dtypes = sorted({str(p.dtype).replace("torch.", "") for m in modules for p in m.parameters()})
print(json.dumps({"base": base, "end": end, "peak": peak, "seconds": seconds, "model_bytes": model_bytes,
                  "dtypes": dtypes, "params": sum(p.numel() for m in modules for p in m.parameters())}))
'''


def run_case(file: Path, dtype: str, hub: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(file), dtype], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_file(path: Path, file_dtype: str) -> int:
    import torch
    from original_layouts import sdxl_original, write_sparse_safetensors

    from runner.parts import build_trainer
    from runner.cli.compose import compose_config
    from runner.families.sdxl.architecture import sdxl_configs

    models = build_trainer(compose_config(["trainer=sdxl", "model.size=full"])).build_models("meta")
    state = sdxl_original(models, sdxl_configs("full"))
    dtype = getattr(torch, file_dtype)
    return write_sparse_safetensors(path, {k: (tuple(v.shape), dtype) for k, v in state.items()})


def tokenizer_cache(root: Path) -> Path:
    """A hub cache holding stabilityai/stable-diffusion-xl-base-1.0's tokenizer folders, which an SDXL
    single file needs; here the runner's generated ones stand in for the real ones (a few KB, no download)."""
    from original_layouts import hub_cache

    from runner.parts import build_trainer
    from runner.cli.compose import compose_config

    tiny = build_trainer(compose_config(["trainer=sdxl"]))
    folder = root / "tokenizers"
    for name in ("tokenizer", "tokenizer_2"):
        tok = tiny.tokenizer(name)
        tok.model_max_length = 77
        tok.save_pretrained(folder / name)
    hub_cache(root / "hub", "stabilityai/stable-diffusion-xl-base-1.0", folder)
    return root / "hub"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace this section of docs/benchmarks.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
        files: dict[str, tuple[Path, int]] = {}
        hub = tokenizer_cache(Path(tmp))
        for file_dtype, dtype in CASES:
            if file_dtype not in files:
                path = Path(tmp) / f"sd_xl_full_{file_dtype}.safetensors"
                files[file_dtype] = (path, write_file(path, file_dtype))
            path, data_bytes = files[file_dtype]
            r = run_case(path, dtype, hub)
            grown = r["peak"]["rss"] - r["base"]["VmRSS"]
            hwm = r["end"]["VmHWM"] - r["base"]["VmRSS"]
            target = r["model_bytes"]
            rows.append((file_dtype, dtype, data_bytes, target, max(grown, hwm), r["peak"]["anon"] - r["base"]["RssAnon"],
                         r["end"]["VmRSS"] - r["base"]["VmRSS"], r["seconds"], r["params"]))
            print(f"{file_dtype} file ({gib(data_bytes)}) -> {dtype}: modules {gib(target)}, peak RSS +{gib(max(grown, hwm))} "
                  f"({max(grown, hwm) / target:.2f}x), anonymous +{gib(rows[-1][5])}, after loading +{gib(rows[-1][6])}, "
                  f"{r['seconds']:.1f} s", flush=True)
    # the files are gone with the temporary folder (sparse: they never took disk space)
    load = os.getloadavg()
    lines = [
        MARK_BEGIN,
        "## Loading a full-size single file: peak host RAM (bench/load_memory.py)",
        "",
        f"`python bench/load_memory.py --write` on {platform.machine()}, {os.cpu_count()} cores, torch "
        f"{__import__('torch').__version__}, {time.strftime('%Y-%m-%d')}, load average {load[0]:.1f} / {load[1]:.1f} "
        "(shared machine). SDXL's full checkpoint in the A1111/ComfyUI layout (U-Net, VAE, CLIP-L, OpenCLIP bigG, "
        f"{rows[0][8] / 1e9:.2f} B parameters, all zeros, sparse file), loaded by `SDXLTrainer.build_models` "
        "(`model.train=lora`: every module in `model.dtype`, but the LoRA adapters, float32, and with float16 the VAE, "
        "float32 since its config sets force_upcast) in a fresh process; "
        "RSS above the process's RSS before loading (the kernel's peak, VmHWM, and a 2 ms sampler).",
        "",
        "| file | model.dtype | file data | modules as loaded | peak RSS during loading | ratio | "
        "of it anonymous | RSS after loading | time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fd, d, data, target, peak, anon, after, secs, _ in rows:
        lines.append(f"| {fd} | {d} | {gib(data)} | {gib(target)} | +{gib(peak)} | {peak / target:.2f}x | +{gib(anon)} | "
                     f"+{gib(after)} | {secs:.1f} s |")
    lines += [
        "",
        "Converted tensors are new memory in the target dtype; the file's pages read for a conversion stay in RSS "
        "only until the file is reopened (every 256 MiB, runner/families/common/single_file.py), so the peak is the modules "
        "plus about one such chunk. Tensors already in the target dtype are views of the file's copy-on-write "
        "mapping: nothing is copied while loading, and their pages join RSS (as file-backed, reclaimable pages) "
        "when first used.",
        MARK_END,
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(text, MARK_BEGIN, MARK_END)


if __name__ == "__main__":
    main()
