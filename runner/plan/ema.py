"""The planner's view of the EMA of the trained weights (``ema.enabled``; runner/ema/average.py).

The simulation builds the same :class:`~runner.ema.average.EMA` the loop builds, over the simulated run's
trained parameters as the plugins placed them, right after the optimizer (where the loop builds
it): its copy is fake tensors on the simulated device or the fake host, so the tracker counts it
where it will live, under the category ``ema`` and the trained module's name, and it stays live
through every later phase (forward, backward, optimizer), as in a run. After the optimizer step
one update runs (phase ``ema update``), which counts its temporaries (at most
:data:`runner.ema.average.CHUNK_BYTES` of weights cast to the EMA dtype or staged on the host).

What the plan reports (``Plan.ema``, a line of the table): the copy's bytes on the device and on
the host, its dtype and placement; under ``dist=fsdp`` one rank's (its shards' EMA, a
``1/shard group`` share, moved to the host with ``dist.cpu_offload``: runner/plan/dist.py), as in
each phase's ``ema`` column. With EMA off nothing is simulated and the plan is byte for
byte what it was without this module (bench/plan_snapshot.py).
"""
from __future__ import annotations

from typing import Any

from runner.ema.average import CATEGORY, EMA

PHASE = "ema"
UPDATE_PHASE = "ema update"


class NoEMAPlan:
    """``ema.enabled=false``: nothing to plan."""

    def create(self) -> None:
        pass

    def update(self) -> None:
        pass

    def report(self, plan: Any) -> None:
        pass

    def host_excess(self) -> int:
        return 0


class EMAPlan:
    """:meth:`create` after the simulated optimizer is built, :meth:`update` after its step,
    :meth:`report` on the assembled plan."""

    def __init__(self, sim: Any, config: Any) -> None:
        self.sim, self.config = sim, config
        self.ema: EMA | None = None
        self.bytes: dict[str, int] = {}

    def create(self) -> None:
        from runner.plan.target import HOST

        sim = self.sim
        tracker, models = sim.tracker, sim.ctx.models
        c = self.config
        with tracker.phase(PHASE, category=CATEGORY):
            self.ema = EMA(list(models.named_trainable_parameters()), decay=float(c.decay), warmup=bool(c.warmup),
                           every=int(c.every), start=int(c.start), on_host=str(c.device) == "cpu",
                           dtype=sim.run.ema_dtype, host=HOST)
        for p, s in zip(self.ema.params, self.ema.shadow):
            tracker.track(s, CATEGORY, module=sim.owner.get(id(p)))
        sim.recorder.take(PHASE)
        self.bytes = self.ema.nbytes()

    def update(self) -> None:
        sim = self.sim
        with sim.tracker.phase(UPDATE_PHASE, category="temporaries"):
            self.ema.average(1.0 - self.ema.decay_at(0))
        sim.recorder.take(UPDATE_PHASE)

    def host_excess(self) -> int:
        """Bytes of a host copy (``ema.device=cpu``) the simulated process holds beyond one rank's share
        under dist=fsdp: what the host's steady figure, counted by the tracker, loses for one rank."""
        from runner.plan.target import HOST

        layout = self.sim.rank_layout
        if layout is None or layout.name != "fsdp":
            return 0
        held = self.bytes.get(HOST.type, 0)
        return held - int(held * layout.state_share)

    def report(self, plan: Any) -> None:
        from runner.plan.dist import rank_state_bytes
        from runner.plan.target import DEVICE, HOST

        ema = self.ema
        where = rank_state_bytes(self.sim.rank_layout, self.bytes)  # dist=fsdp: this rank's shards
        plan.ema = {
            "device": str(self.config.device),  # ema.device: device (beside each weight) | cpu
            "dtype": str(ema.dtype).replace("torch.", ""),
            "device_bytes": where.get(DEVICE.type, 0),
            "host_bytes": where.get(HOST.type, 0),
            "parameters": sum(p.numel() for p in ema.params),
            "tensors": len(ema.params),
            "update_peak_bytes": plan.phases.get(UPDATE_PHASE, 0),
        }


def plan_ema(sim: Any) -> EMAPlan | NoEMAPlan:
    """The EMA of ``sim``'s run (``cfg.ema``), or a no-op when it is off."""
    c = sim.cfg.get("ema") if hasattr(sim.cfg, "get") else None
    if c is None or not c.enabled or sim.run.ema_dtype is None:
        return NoEMAPlan()
    return EMAPlan(sim, c)
