"""The GPU a run is for: ``device.name`` (a row of conf/devices.yaml), ``device.spec`` (a user's YAML), fields.

A named device gives the planner two things: the default memory budget (its usable memory; a
larger ``budget_gb`` is capped to it) and the figures of the step-time model
(runner/plan/speed.py: peak FLOP/s per precision, memory and PCIe bandwidth). The table is data,
not code: ``conf/devices.yaml`` cites each figure's datasheet. A user adds a card without editing
it: ``device.spec=my_gpu.yaml`` holds one entry's fields (and a ``name``), and single fields can be
overridden on the command line (``device.name=rtx4090 device.h2d_gbps=25``).

The same file's ``interconnects`` rows are the links between GPUs (NVLink, PCIe, InfiniBand): the
communication time of ``dist=ddp|fsdp`` plans (runner/plan/comm.py), chosen with ``dist.interconnect``
(default: the device row's ``link``) and ``dist.inter_node_interconnect``.

This module stays light (a YAML read, no torch): runner/config/__init__.py imports it for the schema and
runner/resolved.py resolves the spec once per run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from runner.errors import UserError, valid_list

FIELDS = ("bf16_tflops", "tf32_tflops", "fp32_tflops", "hbm_gbps", "h2d_gbps", "memory_gib", "usable_gib")
REFERENCE = "rtx4090"  # predicted s/step when no device is named: the most common 24 GB training card


@dataclass
class DeviceConfig:
    """``device``: the GPU the run is for (budget default and step-time model)."""

    name: Optional[str] = None  # a row of conf/devices.yaml (device.name=rtx4090); None: no budget default, s/step for the reference card
    spec: Optional[str] = None  # a YAML file with one device's fields (and its name): your own card
    bf16_tflops: Optional[float] = None  # override: peak dense BF16 tensor TFLOP/s (FP32 accumulate)
    tf32_tflops: Optional[float] = None  # override: peak dense TF32 tensor TFLOP/s
    fp32_tflops: Optional[float] = None  # override: peak FP32 TFLOP/s
    hbm_gbps: Optional[float] = None  # override: memory bandwidth, GB/s
    h2d_gbps: Optional[float] = None  # override: PCIe host-to-device bandwidth, GB/s, one direction
    memory_gib: Optional[float] = None  # override: memory as nvidia-smi reports it, GiB
    usable_gib: Optional[float] = None  # override: memory a training process can allocate, GiB


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU's published peaks (dense) and memory, as the speed model and the budget use them."""

    name: str
    label: str
    bf16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    hbm_gbps: float
    h2d_gbps: float
    memory_gib: float
    usable_gib: float
    link: str = ""  # the interconnects row two of these cards in one server use (conf/devices.yaml); "": not said

    def describe(self) -> str:
        return (f"{self.label}: {self.bf16_tflops:g} TFLOP/s bf16, {self.hbm_gbps:g} GB/s memory, "
                f"{self.h2d_gbps:g} GB/s host-to-device, {self.usable_gib:g} GiB usable")


def _table_path() -> Path:
    from runner.files import conf_dir

    return conf_dir() / "devices.yaml"


@functools.cache
def device_table() -> dict[str, dict[str, Any]]:
    """conf/devices.yaml's rows by name."""
    return dict(yaml.safe_load(_table_path().read_text())["devices"])


def _check_fields(values: dict[str, Any], where: str) -> None:
    missing = [f for f in FIELDS if values.get(f) is None]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}: a device needs {', '.join(FIELDS)} "
                        "(see conf/devices.yaml for their meaning and units).")
    for f in FIELDS:
        v = values[f]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UserError(f"{where}: {f}={v!r} is not valid: give a number > 0 (conf/devices.yaml explains the units).")
    if values["usable_gib"] > values["memory_gib"]:
        raise UserError(f"{where}: usable_gib={values['usable_gib']} is more than memory_gib={values['memory_gib']}.")


def _read_spec_file(path: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"device.spec={path!r} is not a file. Give a YAML file with one device's fields "
                        f"({', '.join(FIELDS)}, and name/label), like an entry of conf/devices.yaml.")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"device.spec={path!r} is not valid YAML ({str(e).splitlines()[0]}).") from None
    if not isinstance(data, dict):
        raise UserError(f"device.spec={path!r} must hold a mapping of fields ({', '.join(FIELDS)}).")
    if isinstance(data.get("devices"), dict) and len(data["devices"]) == 1:  # a one-row table, copied from ours
        (name, row), = data["devices"].items()
        data = {"name": name, **row}
    return data


def device_spec(node: Any) -> Optional[DeviceSpec]:
    """The DeviceSpec ``node`` (the ``device`` config node) describes; None when it names none."""
    if node is None:
        return None
    get = node.get if hasattr(node, "get") else (lambda k, d=None: getattr(node, k, d))
    name, spec_file = get("name"), get("spec")
    overrides = {f: get(f) for f in FIELDS if get(f) is not None}
    if name is None and spec_file is None and not overrides:
        return None
    values: dict[str, Any] = {}
    where = "device"
    if name is not None:
        table = device_table()
        if str(name) not in table and spec_file is None:
            raise UserError(f"device.name={name!r} is not a known device. Valid names: {valid_list(str(name), table)}. "
                            "A card of your own: device.spec=<file.yaml> (see conf/devices.yaml).")
        values.update(table.get(str(name), {}))
        where = f"device.name={name}"
    if spec_file is not None:
        values.update(_read_spec_file(str(spec_file)))
        where = f"device.spec={spec_file}"
    values.update(overrides)
    _check_fields(values, where)
    key = str(values.get("name") or name or (Path(str(spec_file)).stem if spec_file else "custom"))
    return DeviceSpec(name=key, label=str(values.get("label") or key), link=str(values.get("link") or ""),
                      **{f: float(values[f]) for f in FIELDS})


def reference_spec() -> DeviceSpec:
    """The card a plan's s/step is given for when no device is named (:data:`REFERENCE`)."""
    return DeviceSpec(name=REFERENCE, **{k: (float(v) if k in FIELDS else v) for k, v in device_table()[REFERENCE].items()})


LINK_FIELDS = ("gbps", "hop_latency_us")
DEFAULT_LINK = "pcie4_x16"  # between GPUs whose device names no link (or no device named): the common PCIe card


@dataclass(frozen=True)
class LinkSpec:
    """One interconnect (a row of conf/devices.yaml's ``interconnects``): what a ring collective's step
    is bounded by. ``gbps``: GB/s one GPU sends in one direction while receiving as much."""

    name: str
    label: str
    gbps: float
    hop_latency_us: float

    def describe(self) -> str:
        return f"{self.label} ({self.gbps:g} GB/s per direction, {self.hop_latency_us:g} us per ring step)"


@functools.cache
def link_table() -> dict[str, dict[str, Any]]:
    """conf/devices.yaml's ``interconnects`` rows by name."""
    return dict(yaml.safe_load(_table_path().read_text()).get("interconnects") or {})


def link_spec(name: str, key: str = "dist.interconnect") -> LinkSpec:
    """The interconnect ``name`` names; UserError naming ``key`` and the valid names when it names none."""
    table = link_table()
    if str(name) not in table:
        raise UserError(f"{key}={name!r} is not a known interconnect. Valid names: {valid_list(str(name), table)} "
                        "(conf/devices.yaml, interconnects: each row's bandwidth per direction and its source).")
    row = table[str(name)]
    for f in LINK_FIELDS:
        v = row.get(f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UserError(f"conf/devices.yaml, interconnects.{name}.{f}={v!r} is not valid: give a number > 0.")
    return LinkSpec(name=str(name), label=str(row.get("label") or name), **{f: float(row[f]) for f in LINK_FIELDS})


def intra_node_link(configured: str, gpu: DeviceSpec | None) -> LinkSpec:
    """The link between the GPUs of one node: ``dist.interconnect`` when set, else the device's ``link``
    (conf/devices.yaml), else :data:`DEFAULT_LINK` (the reference card's PCIe)."""
    if configured:
        return link_spec(configured)
    return link_spec((gpu.link if gpu is not None and gpu.link else DEFAULT_LINK), "device link")


def check_device_config(cfg: Any) -> None:
    """``device.*`` is valid, and names a GPU only for a run that is for one."""
    spec = device_spec(cfg.get("device"))
    if spec is not None and spec.link:
        link_spec(spec.link, f"the device's link ({spec.name})")
    if spec is not None and str(cfg.train.device) == "cpu":
        raise UserError(f"device.name/device.spec describe a GPU ({spec.label}), but train.device=cpu plans and runs "
                        "on this CPU (its step time comes from a short measurement of the CPU). Drop the device.* "
                        "settings, or drop train.device=cpu to plan for the GPU.")
