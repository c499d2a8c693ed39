"""runner.files: what the runner writes has the modes open() and mkdir() would give it (0644/0755 under
umask 022), including the files written through temporary files (mkstemp, safetensors: 0600)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runner.files import current_umask, fix_tree_modes
from runner.output.report import write_text_atomic
from runner.plugins.park.entry import write_entry


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=["umask022", "umask077", "umask002"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_current_umask_reads_without_changing_it(umask):
    assert current_umask() == umask
    assert current_umask() == umask


def test_atomic_writes_and_staged_folders_get_open_and_mkdir_modes(tmp_path, umask):
    fmode, dmode = 0o666 & ~umask, 0o777 & ~umask
    write_text_atomic(tmp_path / "job_summary.json", "{}\n")
    assert mode(tmp_path / "job_summary.json") == fmode
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # the reference: what open() does
    assert mode(plain) == fmode

    entry = tmp_path / "cache" / "ab" / "abc.safetensors"
    write_entry(entry, {"x": torch.zeros(2)}, "latents", "abc")
    assert mode(entry) == fmode

    staged = tmp_path / "staged"
    (staged / "sub").mkdir(parents=True)
    save_file({"w": torch.ones(1)}, str(staged / "sub" / "trainable.safetensors"))
    os.chmod(staged, 0o700)
    assert mode(staged / "sub" / "trainable.safetensors") == 0o600 or umask == 0o077  # what safetensors does
    fix_tree_modes(staged)
    assert mode(staged) == dmode and mode(staged / "sub") == dmode
    assert mode(staged / "sub" / "trainable.safetensors") == fmode


def test_swap_in_folder_over_a_file_leaves_nothing_hidden(tmp_path):
    from runner.files import swap_in_folder

    final, tmp = tmp_path / "export", tmp_path / ".tmp-export-1"
    final.write_text("a file where the export goes")
    tmp.mkdir()
    (tmp / "lora.safetensors").write_bytes(b"x")
    swap_in_folder(tmp, final)
    assert final.is_dir() and (final / "lora.safetensors").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
