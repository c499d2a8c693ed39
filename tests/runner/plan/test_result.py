"""The printed plan compares the host peak with this machine's RAM (runner/plan/result.py)."""
from __future__ import annotations

import psutil

from runner.plan.result import _host_ram_lines


def test_a_host_peak_over_the_machines_ram_says_so_and_what_to_change():
    ram = psutil.virtual_memory().total
    (over,) = _host_ram_lines(ram + 2**30)
    assert over.startswith("  OVER this machine's RAM") and "by 1.00 GiB" in over and "model.path=" in over
    (fits,) = _host_ram_lines(ram // 2)
    assert fits.startswith("  fits this machine's RAM")
