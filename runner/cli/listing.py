"""The text of ``python -m runner mode=plugins``: every plugin, trainer, loss option, optimizer,
device and fit key with its type and default, from the light schemas (no torch, no output folder)."""
from __future__ import annotations

from runner.registry import describe_config, plugin_entries, trainers


def format_plugin_list() -> str:
    """The text of ``python -m runner mode=plugins``."""
    lines = ["Plugins (select with <kind>=<name> or <kind>=[<name>,<name>], add one to a preset's with",
             "+<kind>=<name>, set parameters with <kind>.<name>.<param>=<value>):", ""]
    current = None
    for (kind, name), entry in plugin_entries().items():
        if kind != current:
            lines.append(f"{kind}:")
            current = kind
        lines.append(f"  {name:<12} {entry.description}")
        for fname, ftype, default in describe_config(entry.config):
            lines.append(f"      {kind}.{name}.{fname}: {ftype} = {default!r}")
    from runner.distributed import describe_options

    lines += ["", *describe_options()]
    lines += ["", "Trainers (select with trainer=<name>, or trainer._target_=module.Class):"]
    for name, entry in sorted(trainers().items()):
        lines.append(f"  {name:<12} {entry.description}")
        for fname, ftype, default in describe_config(entry.config):
            lines.append(f"      trainer.{fname}: {ftype} = {default!r}")
    from runner.loss.config import describe_loss_options

    lines += ["", *describe_loss_options()]
    return "\n".join(lines + _other_groups())


def _other_groups() -> list[str]:
    """Optimizers, the device table and the fit search: groups that are not plugins, with their keys."""
    from runner.devices import DeviceConfig, device_table
    from runner.config.fit import ALLOW, FitConfig
    from runner.optim.config import OPTIMIZER_CONFIGS

    lines = ["", "Optimizers (select with optimizer=<name>, runner/optim/build.py):"]
    for name, config in OPTIMIZER_CONFIGS.items():
        lines.append(f"  {name}")
        for fname, ftype, default in describe_config(config):
            lines.append(f"      optimizer.{fname}: {ftype} = {default!r}")
    lines += ["", "Devices (device.name=<name>: budget default and step-time model; conf/devices.yaml, runner/devices.py):"]
    for name, row in device_table().items():
        lines.append(f"  {name:<14} {row['label']}: {row['bf16_tflops']:g} TFLOP/s bf16 (dense), "
                     f"{row['hbm_gbps']:g} GB/s, {row['usable_gib']:g} GiB usable")
    lines.append("      device.name: Optional[str] = None (one of the names above)")
    for fname, ftype, default in describe_config(DeviceConfig):
        lines.append(f"      device.{fname}: {ftype} = {default!r}")
    lines += ["", "Fit (mode=fit, train.auto_fit=true; runner/fit/):"]
    for fname, ftype, default in describe_config(FitConfig):
        lines.append(f"      fit.{fname}: {ftype} = {default!r}")
    lines += [f"      fit.allow: {name} = {what}" for name, what in ALLOW.items()]
    return lines
