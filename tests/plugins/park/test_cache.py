"""Encoder-cache integrity: damaged entries are found before training and re-encoded; read-only caches.

Faults are real bytes on disk (overwritten, truncated, emptied, an older format) and a really
read-only mount (tests/faults.py); runs are the tiny SDXL trainer. "Repaired" is checked by
value: the re-encoded file has exactly the bytes the clean fill wrote, and the run's losses equal
the clean run's bit for bit. Subprocess runs (``python -m runner``) are few: a reference run, one
read-only run that trains, one that is refused, and two runs sharing one cache at the same time.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from faults import faults_supported, with_faults
from safetensors.torch import load_file, save_file

from runner.parts import build_plugins, build_trainer, make_context, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.loop import train
from runner.plugins.park.cache import EncoderCache
from runner.plugins.park.entry import FORMAT, parse, verify_entry
from runner.resolved import resolve
from runner.session import make_accelerator

ROOT = Path(__file__).resolve().parents[3]

# One intra-op thread (tests/conftest.py): bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.safetensors") if not p.name.startswith("."))


def part_key(path: Path) -> tuple[str, str]:
    return path.parent.parent.name, path.stem


def all_verify(root: Path) -> bool:
    return all(verify_entry(p, *part_key(p)) is None for p in entries(root))


def damage_data(path: Path, n: int = 64, seed: int = 0) -> None:
    """Overwrite ``n`` bytes inside the entry's tensor data with different random bytes, in place."""
    blob = bytearray(path.read_bytes())
    start = len(blob) - len(parse(bytes(blob))[2])  # where the data region begins
    rng = random.Random(seed)
    at = rng.randrange(start, len(blob) - n)
    for i in range(at, at + n):
        blob[i] ^= rng.randrange(1, 256)  # never the same byte again
    with open(path, "r+b") as f:  # in place, as a disk fault would: same inode, same size
        f.write(blob)


# ---- one entry on disk ------------------------------------------------------------------------
def test_entry_round_trip_and_every_fault_is_named(tmp_path):
    cache = EncoderCache(tmp_path)
    tensors = {"prompt_embeds": torch.randn(7, 16), "pooled": torch.randn(8).half()}
    path = cache.save("text", "ab12", tensors)
    assert cache.verify("text", "ab12") is None
    loaded = load_file(path)  # still a plain safetensors file
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert cache.verify("text", "cd34") == "missing"
    good = path.read_bytes()

    damage_data(path)
    assert cache.verify("text", "ab12").startswith("checksum mismatch")
    path.write_bytes(good[:-100])
    assert cache.verify("text", "ab12").startswith("truncated")
    path.write_bytes(good[:5])
    assert cache.verify("text", "ab12").startswith("truncated")
    path.write_bytes(b"")
    assert cache.verify("text", "ab12") == "empty file"
    path.write_bytes(good + b"\0" * 8)
    assert cache.verify("text", "ab12").startswith("truncated or padded")
    save_file(tensors, path, metadata={"format": "runner-encoder-cache/1", "part": "text", "key": "ab12"})
    assert "written by an older version" in cache.verify("text", "ab12")
    path.write_bytes(good)
    assert cache.verify("text", "ab12") is None
    cache.path("text", "ef56").parent.mkdir()
    shutil.copy(path, cache.path("text", "ef56"))  # a file under another key
    assert cache.verify("text", "ef56") == "holds part 'text' key 'ab12', not this one"


def test_header_damage_is_caught_too(tmp_path):
    """The checksum covers names, dtypes and shapes: a header edit that keeps sizes consistent still fails."""
    cache = EncoderCache(tmp_path)
    path = cache.save("latents", "k", {"mean": torch.randn(4, 2, 2), "std": torch.rand(4, 2, 2)})
    blob = path.read_bytes()
    assert b'"shape":[4,2,2]' in blob
    path.write_bytes(blob.replace(b'"shape":[4,2,2]', b'"shape":[2,4,2]', 1))
    assert cache.verify("latents", "k").startswith("checksum mismatch")
    path.write_bytes(blob.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1))
    assert cache.verify("latents", "k").startswith("checksum mismatch")
    path.write_bytes(blob.replace(b'"__metadata__"', b'"__metadata_x"', 1))
    assert cache.verify("latents", "k").startswith("unreadable header")
    path.write_bytes(blob[:8] + b"\xff" + blob[9:])
    assert cache.verify("latents", "k").startswith("unreadable header")


def test_verify_many_names_every_bad_entry_with_and_without_threads(tmp_path):
    cache = EncoderCache(tmp_path)
    keys = [f"{i:04x}" for i in range(40)]
    for k in keys:
        cache.save("text", k, {"e": torch.full((3,), float(int(k, 16)))})
    damage_data(cache.path("text", keys[3]), n=4)
    cache.path("text", keys[17]).write_bytes(b"")
    want = {("text", keys[3]), ("text", keys[17]), ("text", "absent")}
    for threads in (1, 2):
        bad = cache.verify_many([("text", k) for k in [*keys, "absent"]], threads=threads)
        assert set(bad) == want and bad[("text", "absent")] == "missing"


# ---- runs in this process -----------------------------------------------------------------------
def run_losses(out: Path, cache: Path, *overrides: str) -> list[float]:
    """The steps of runner.__main__.run (no preflight), training the tiny SDXL with offload=park."""
    cfg = compose_config([f"output_dir={out}", "train.progress=false", "data.demo_size=4", "train.steps=3",
                          "offload=park", f"offload.park.cache_dir={cache}", *overrides])
    validate(cfg)
    run = resolve(cfg)
    ctx = make_context(cfg, run, build_plugins(cfg, run), out)
    ctx.run_phase("configure_process")
    ctx.trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    ctx.models = prepare_models(ctx.trainer.build_models("cpu"), cfg.model, run)
    ctx.accelerator = make_accelerator(run)
    try:
        ctx.apply_setup_phases()
        return train(ctx).losses
    finally:
        ctx.teardown()


@pytest.fixture(scope="module")
def clean(tmp_path_factory, one_thread) -> tuple[Path, list[float]]:
    """A cache filled by a clean run, and that run's losses."""
    tmp = tmp_path_factory.mktemp("clean")
    losses = run_losses(tmp / "run", tmp / "cache")
    assert len(entries(tmp / "cache")) == 8 and all_verify(tmp / "cache")
    return tmp / "cache", losses


def copy_cache(clean_cache: Path, tmp: Path) -> Path:
    shutil.copytree(clean_cache, tmp / "cache")
    return tmp / "cache"


def test_random_bytes_in_one_entry_are_caught_and_reencoded(clean, tmp_path, caplog):
    cache = copy_cache(clean[0], tmp_path)
    victim = entries(cache / "text")[0]
    original = victim.read_bytes()
    damage_data(victim)
    with caplog.at_level(logging.INFO, logger="runner"):
        losses = run_losses(tmp_path / "run", cache)
    assert f"1 entry failed verification (first: {victim}: checksum mismatch" in caplog.text
    assert "re-encoding it" in caplog.text and "encoding 1 entries (text: 1)" in caplog.text
    assert losses == clean[1]  # bit for bit: the damaged embedding never reached the U-Net
    assert victim.read_bytes() == original  # re-encoded to exactly what the clean fill wrote
    assert all_verify(cache)


def test_truncated_empty_and_old_format_entries_are_reencoded(clean, tmp_path, caplog):
    cache = copy_cache(clean[0], tmp_path)
    latents, text = entries(cache / "latents"), entries(cache / "text")
    originals = {p: p.read_bytes() for p in (latents[0], latents[1], text[1])}
    latents[0].write_bytes(originals[latents[0]][: len(originals[latents[0]]) // 2])
    text[1].write_bytes(b"")
    old = load_file(latents[1])  # the same tensors, written by the previous format (no checksum)
    save_file(old, latents[1], metadata={"format": "runner-encoder-cache/1", "part": "latents", "key": latents[1].stem})
    assert FORMAT != "runner-encoder-cache/1"
    with caplog.at_level(logging.INFO, logger="runner"):
        losses = run_losses(tmp_path / "run", cache)
    assert "3 entries failed verification" in caplog.text and "encoding 3 entries (latents: 2, text: 1)" in caplog.text
    assert losses == clean[1]
    assert {p: p.read_bytes() for p in originals} == originals
    assert all_verify(cache)


# ---- separate processes: read-only media, two runs on one cache ---------------------------------
CLI = ["train.progress=false", "train.preflight=false", "data.demo_size=4", "data.resolution=32", "train.steps=2",
       "offload=park"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # one thread: bitwise-equal across processes


def cli_command(out: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "runner", *CLI, f"output_dir={out}", f"offload.park.cache_dir={cache}"]


def cli_losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def finished(proc: subprocess.CompletedProcess | subprocess.Popen, out: str, err: str) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[float]]:
    """A complete cache filled by ``python -m runner`` with a fresh cache folder, and its losses."""
    tmp = tmp_path_factory.mktemp("reference")
    r = subprocess.run(cli_command(tmp / "run", tmp / "cache"), cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, finished(r, r.stdout, r.stderr)
    assert len(entries(tmp / "cache")) == 8 and all_verify(tmp / "cache")
    return tmp / "cache", cli_losses(tmp / "run")


def test_two_runs_filling_one_cache_at_once_both_train_like_a_fresh_cache(reference, tmp_path):
    cache = tmp_path / "shared"
    procs = [subprocess.Popen(cli_command(tmp_path / f"run{i}", cache), cwd=ROOT, env=ENV, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, finished(proc, out, err)
    assert cli_losses(tmp_path / "run0") == cli_losses(tmp_path / "run1") == reference[1]
    assert [p.relative_to(cache) for p in entries(cache)] == [p.relative_to(reference[0]) for p in entries(reference[0])]
    assert all_verify(cache)
    assert all(p.read_bytes() == (reference[0] / p.relative_to(cache)).read_bytes() for p in entries(cache))
    assert not list(cache.rglob(".tmp-*"))  # no temporary file left behind by either writer


@pytest.fixture
def read_only_runs():
    if not faults_supported():
        pytest.skip("this kernel refuses unprivileged user namespaces: no real read-only mount (tests/faults.py)")


def test_complete_cache_on_read_only_media_trains(reference, tmp_path, read_only_runs):
    cache = copy_cache(reference[0], tmp_path)
    before = {p: p.stat().st_mtime_ns for p in entries(cache)}
    r = subprocess.run(with_faults(cli_command(tmp_path / "run", cache), read_only=[cache]), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, finished(r, r.stdout, r.stderr)
    assert "latents 4/4 entries cached, text 4/4 entries cached" in r.stderr + r.stdout
    assert cli_losses(tmp_path / "run") == reference[1]
    assert {p: p.stat().st_mtime_ns for p in entries(cache)} == before


def test_read_only_cache_with_a_bad_entry_stops_before_training(reference, tmp_path, read_only_runs):
    cache = copy_cache(reference[0], tmp_path)
    victim = entries(cache / "latents")[2]
    damage_data(victim)
    r = subprocess.run(with_faults(cli_command(tmp_path / "run", cache), read_only=[cache]), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    both = r.stdout + r.stderr
    assert r.returncode == 2, finished(r, r.stdout, r.stderr)
    assert "Traceback" not in both
    assert f"offload.park.cache_dir='{cache}' cannot be written" in both
    assert "1 of the 8 encoder cache entries this run needs must be encoded there" in both
    assert f"1 entry failed verification (first: {victim}: checksum mismatch" in both
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
