"""Estimates of a candidate's peak and step time from a few planned configurations (the anchors).

A full plan of every candidate would take minutes, so the search plans two configurations (the
user's own and the same with the opposite checkpointing extreme) and estimates the rest from
their per-category breakdowns at the peak and their per-phase costs, category by category:

* weights: the trained modules' (at their storage dtype, less what a stream keeps on the host,
  quantized under LoRA) and the frozen modules' still on the device (none once park caches
  their outputs and drops them);
* gradients: the trained weights' (none beyond the largest parameter's with fused backward);
* optimizer state: by optimizer (8-bit: ~0.25 of AdamW's), none on the device with optimizer
  offload, the streamed share on the host;
* activations and temporaries: the anchor with the candidate's checkpointing (every 2nd block:
  their mean), scaled by the micro-batch; activation offload keeps ~15 % on the device (the
  stash and the tensors in flight: tests/plugins/test_offload_activations.py measured 10-15 %).

Adding categories that peak at different moments overestimates a little, which errs on the safe
side; the chosen candidate is confirmed by a full plan anyway. Step times go through the same
model as a plan's (runner/plan/speed.py) with the anchor's per-phase counts, the candidate's copies
(streamed blocks, offloaded activations, the optimizer's round trip) and its optimizer update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runner.blocks import find_repeated_blocks
from runner.context import Transfer
from runner.fit.space import Knobs, offload_knobs
from runner.plan.cost import CostCounter, PhaseCost
from runner.plan.host import StepShape
from runner.plan.result import Plan
from runner.plan.speed import STEP_PHASES, StepTime, Target, Trained, predict
from runner.plan.target import CUDA_WORKSPACE_MARGIN_BYTES

GiB = 2**30
ACTIVATION_OFFLOAD_KEEPS = 0.15  # share of saved activations left on the device by offload=activations
STATE_8BIT_OF_ADAMW = (2 + 8 / 256) / 8  # two uint8 moments + absmax per 256, against two float32 moments
NF4_BYTES, FP8_BYTES = 0.5 + 4 / 64, 1.0  # per element: packed 4-bit + absmax per 64; fp8 storage


@dataclass
class Inventory:
    """The run's models as prepared for it (dtypes, LoRA), measured on ``meta``: what the estimates scale."""

    weights: dict[str, int]  # module -> parameter and buffer bytes
    trained: set[str]
    trained_bytes: int  # trainable parameters
    trained_elements: int
    trained_params: int
    largest_param_bytes: int
    frozen_linear_elements: int  # frozen nn.Linear weights in the trained modules (a LoRA's base)
    blocks: int  # repeated blocks of the trained modules
    block_bytes: list[int]  # their parameter bytes (a stream's window is the largest of them)
    lora_elements: int  # adapters' elements if model.train=lora were chosen (model.lora_targets, lora_rank)

    @classmethod
    def of(cls, models: Any, cfg: Any) -> Inventory:
        weights = {n: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
                   for n, m in models.items()}
        params = list(models.trainable_parameters())
        frozen_linear = lora = 0
        block_bytes: list[int] = []
        targets = tuple(str(t) for t in cfg.model.get("lora_targets", []))
        rank = int(cfg.model.get("lora_rank", 4))
        for name in models.trained:
            module = models[name]
            block_bytes += [sum(p.numel() * p.element_size() for p in blk.parameters())
                            for blk in (models.blocks.get(name) or find_repeated_blocks(module))]
            for qual, m in module.named_modules():
                if isinstance(m, nn.Linear):
                    if not m.weight.requires_grad:
                        frozen_linear += m.weight.numel()
                    if qual.endswith(targets):
                        lora += rank * (m.in_features + m.out_features)
        return cls(
            weights=weights, trained=set(models.trained),
            trained_bytes=sum(p.numel() * p.element_size() for p in params),
            trained_elements=sum(p.numel() for p in params), trained_params=len(params),
            largest_param_bytes=max((p.numel() * p.element_size() for p in params), default=0),
            frozen_linear_elements=frozen_linear, blocks=max(len(block_bytes), 1), block_bytes=block_bytes,
            lora_elements=lora,
        )


@dataclass
class Anchor:
    """A planned configuration: its knobs and plan."""

    knobs: Knobs
    plan: Plan

    def category(self, name: str) -> int:
        return int(self.plan.by_category.get(name, 0))

    def module_weights(self, names: set[str]) -> int:
        return sum(int(cats.get("weights", 0)) for m, cats in self.plan.by_module.items() if m in names)

    def per_micro_phases(self) -> dict[str, PhaseCost]:
        n = max(int(self.plan.run["micro_batches"]), 1)
        detail = self.plan.step_time["detail"]["phases"]
        return {p: PhaseCost(**{k: (v / n if p != "optimizer" else v) for k, v in detail[p].items()})
                for p in STEP_PHASES}


@dataclass
class Estimate:
    knobs: Knobs
    peak_bytes: int
    required_bytes: int
    step_time: StepTime
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.step_time.seconds


class Estimator:
    """Estimates candidates from the anchors (see the module docstring)."""

    def __init__(self, anchors: dict[str, Anchor], inventory: Inventory, target: Target, base: Knobs, *,
                 batch: int, on_cuda: bool, train_dtype_bytes: int, frozen_dtype_bytes: int, prefetch: int = 1) -> None:
        self.anchors = anchors  # by checkpoint mode: the base's, and the extremes planned beside it
        self.inv = inventory
        self.target = target
        self.base = base
        self.batch = batch
        self.on_cuda = on_cuda
        self.train_dtype_bytes = train_dtype_bytes
        self.frozen_dtype_bytes = frozen_dtype_bytes
        self.window = sum(sorted(inventory.block_bytes, reverse=True)[: prefetch + 1])  # a stream's blocks in flight

    def refs(self, k: Knobs) -> list[Anchor] | None:
        """The anchors a candidate is estimated from: its checkpointing's, or both extremes (every 2nd block)."""
        if k.checkpoint in self.anchors:
            return [self.anchors[k.checkpoint]]
        if k.checkpoint == "every_n" and "none" in self.anchors and "full" in self.anchors:
            return [self.anchors["none"], self.anchors["full"]]
        return None

    def can_estimate(self, k: Knobs) -> bool:
        if self.refs(k) is None:
            return False
        return k.stream_gb is None or k.stream_gb < 0 or k.stream_gb * GiB > self.window

    # -- memory ------------------------------------------------------------------------------------
    def _streamed(self, k: Knobs, resident: int) -> int:
        """Bytes a stream at ``k.stream_gb`` keeps on the host: all but what fits beside the window."""
        return int(max(resident - (k.stream_gb * GiB - self.window), 0))

    def _peak_from(self, a: Anchor, k: Knobs) -> dict[str, float]:
        inv, b = self.inv, a.knobs
        trained_w = a.module_weights(inv.trained)
        frozen_w = a.module_weights(set(inv.weights) - inv.trained)
        if k.park and not b.park:
            frozen_w = 0  # cached outputs, encoders dropped; a parked VAE visits only during encode
        grads, state = a.category("gradients"), a.category("optimizer_state")
        full = k.train == "full"
        if k.train != b.train:  # full -> lora: the base frozen in model.dtype, adapters trained
            trained_w = sum(inv.weights[n] for n in inv.trained) * self.frozen_dtype_bytes // 4 \
                + inv.lora_elements * self.train_dtype_bytes
            grads = inv.lora_elements * self.train_dtype_bytes
            state = int(state * inv.lora_elements / max(inv.trained_elements, 1))
        if k.train_dtype != b.train_dtype and full:
            trained_w, grads = trained_w // 2, grads // 2
            if k.optimizer == "adamw":
                state //= 2  # torch AdamW keeps its moments in the weights' dtype
        if k.optimizer != b.optimizer and b.optimizer == "adamw":
            state = int(state * STATE_8BIT_OF_ADAMW)
        if k.quantization and not b.quantization:  # the LoRA base's Linear weights, packed
            per = NF4_BYTES if k.quantization == "nf4" else FP8_BYTES
            trained_w = max(trained_w - int(inv.frozen_linear_elements * (self.frozen_dtype_bytes - per)), 0)
        host = float(a.plan.host_training_bytes)  # host RAM during training: the anchor's, plus what moves there
        if k.stream_gb is not None and k.stream_gb >= 0 and k.stream_gb != b.stream_gb:
            streamed = self._streamed(k, trained_w)
            host += streamed
            if full:  # streamed blocks' gradients and state live on the host
                keep = 1 - streamed / max(trained_w, 1)
                host += (grads + state) * (1 - keep)
                grads, state = grads * keep, state * keep
            trained_w = min(trained_w, k.stream_gb * GiB)
        if k.optimizer_offload and not b.optimizer_offload:
            host += state + 2 * grads  # state, host master weights and their gradient buffers
            state = 0
        if k.fused and not b.fused:
            grads = min(grads, inv.largest_param_bytes)
        acts = a.category("activations") * k.micro / b.micro
        temps = a.category("temporaries") * k.micro / b.micro
        # The end of forward: no gradients yet, every saved activation alive. The at-peak breakdown
        # may be another moment (the end of backward), so this one comes from the forward phase's
        # own peak: what it held above the weights, state and batch.
        held = a.category("weights") + a.category("optimizer_state") + a.category("other")
        forward = max(a.plan.phases.get("forward", 0) - held, 0) * k.micro / b.micro
        if k.activations and not b.activations:
            host += max(forward, acts)  # a micro-batch's saved activations wait on the host for its backward
            acts *= ACTIVATION_OFFLOAD_KEEPS
            forward *= ACTIVATION_OFFLOAD_KEEPS
        if forward > grads + acts + temps:  # the peak moves to the end of forward (fused backward, offloads)
            grads, acts, temps = 0, forward, 0
        return {"weights": trained_w + frozen_w, "gradients": grads, "optimizer_state": state,
                "activations": acts, "temporaries": temps, "other": a.category("other"), "host": host}

    def peak(self, k: Knobs) -> tuple[int, dict[str, int]]:
        """(device peak, its parts by category and ``host``: host RAM during training)."""
        refs = self.refs(k) or [self.anchors[self.base.checkpoint]]
        each = [self._peak_from(a, k) for a in refs]
        parts = {c: int(sum(e[c] for e in each) / len(each)) for c in each[0]}
        return int(sum(v for c, v in parts.items() if c != "host")), parts

    # -- time --------------------------------------------------------------------------------------
    def _phases(self, a: Anchor, k: Knobs) -> dict[str, PhaseCost]:
        per = a.per_micro_phases()
        n_micro = self.batch // k.micro
        out: dict[str, PhaseCost] = {}
        for p in STEP_PHASES:
            src = per[p]
            if p == "optimizer":
                out[p] = src
                continue
            work = n_micro * k.micro / a.knobs.micro  # FLOPs and bytes follow the samples; ops the passes
            out[p] = PhaseCost(ops=src.ops * n_micro, kernels=src.kernels * n_micro, flops=src.flops * work,
                               bytes=src.bytes * work, device_s=src.device_s * work, h2d_bytes=int(src.h2d_bytes * n_micro),
                               d2h_bytes=int(src.d2h_bytes * n_micro), host_ops=src.host_ops * n_micro,
                               host_bytes=src.host_bytes * n_micro, host_s=src.host_s * n_micro,
                               engine_ops=src.engine_ops * n_micro, engine_kernels=src.engine_kernels * n_micro,
                               hook_kernels=src.hook_kernels * n_micro, copies=src.copies * n_micro,
                               recompute_flops=src.recompute_flops * work)
        return out

    def _time_from(self, a: Anchor, k: Knobs) -> StepTime:
        inv, b = self.inv, a.knobs
        phases = self._phases(a, k)
        self._drop_base_copies(a, k, phases)
        n_micro = self.batch // k.micro
        transfers: dict[str, Transfer] = {}
        bw = self.target.device.bytes_per_s
        if k.train != b.train:  # LoRA skips the base's weight gradients: about one forward of matmuls
            phases["backward"].device_s = max(phases["backward"].device_s - phases["forward"].device_s, 0.0)
        if k.quantization and not b.quantization:  # dequantize each use: packed weights in, bf16 weights out
            per = NF4_BYTES if k.quantization == "nf4" else FP8_BYTES
            for p, n in {"forward": 1, "backward": 2 if k.checkpoint != "none" else 1}.items():
                phases[p].device_s += n_micro * n * inv.frozen_linear_elements * (per + 2) / bw
        trained = self._trained(k, a)
        if k.stream_gb is not None and k.stream_gb >= 0 and k.stream_gb != b.stream_gb:
            streamed = self._streamed(k, a.module_weights(inv.trained))
            phases["forward"].h2d_bytes += streamed * n_micro
            phases["backward"].h2d_bytes += streamed * n_micro
            grads_out = streamed * n_micro if k.train == "full" else 0  # streamed blocks' gradients go to the host
            phases["backward"].d2h_bytes += grads_out
            if k.train == "full" and n_micro > 1:  # ... where later micro-batches are added to them (read 2, write 1)
                phases["backward"].host_s += 3 * streamed * (n_micro - 1) / self.target.host.bytes_per_s
            transfers[_stream_key()] = Transfer(h2d_bytes=2 * streamed * n_micro, d2h_bytes=grads_out,
                                                   overlapped=True, window_bytes=self.window)
        if k.activations and not b.activations and self.on_cuda:
            saved = int(a.category("activations") * k.micro / b.micro)
            phases["forward"].d2h_bytes += saved * n_micro
            phases["backward"].h2d_bytes += saved * n_micro
            transfers["offload/activations"] = Transfer(h2d_bytes=saved * n_micro, d2h_bytes=saved * n_micro,
                                                        overlapped=True)
        if k.optimizer_offload and not b.optimizer_offload:
            moved = trained.device_bytes
            phases["optimizer"].h2d_bytes += moved
            phases["optimizer"].d2h_bytes += moved
            transfers["offload/optimizer"] = Transfer(h2d_bytes=moved, d2h_bytes=moved,
                                                      host_step_elements=trained.device_elements)
        for key, t in self._base_transfers(a).items():
            if self._kept(key, k, b):
                transfers.setdefault(key, t)
        counter = CostCounter(self.target.device, self.target.host)
        counter.phases = phases
        shape = StepShape(k.optimizer, trained.device_params, n_micro, k.fused)  # the loss read per micro-batch
        return predict(counter, self.target, micro_batches=1, simulated_micro=1, transfers=transfers,
                       optimizer=k.optimizer, trained=trained, fused=k.fused, shape=shape)

    def step_time(self, k: Knobs) -> StepTime:
        refs = self.refs(k) or [self.anchors[self.base.checkpoint]]
        times = [self._time_from(a, k) for a in refs]
        if len(times) == 1:
            return times[0]
        out = times[0]
        out.seconds = sum(t.seconds for t in times) / len(times)
        out.phases = {p: sum(t.phases[p] for t in times) / len(times) for p in out.phases}
        out.flops = sum(t.flops for t in times) / len(times)
        return out

    def _base_transfers(self, a: Anchor) -> dict[str, Transfer]:
        recorded = a.plan.step_time["detail"].get("transfers") or {}
        return {key: Transfer(**t) for key, t in recorded.items()}

    @staticmethod
    def _kept(key: str, k: Knobs, b: Knobs) -> bool:
        """Whether the anchor's plugin ``key`` (whose copies it counted) is unchanged in candidate ``k``."""
        knob = {f"offload/{name}": knob for knob, name in offload_knobs().items()}.get(key)
        if knob is None:  # a plugin the search does not switch
            return True
        if knob == "stream_gb":
            return k.stream_gb is not None and k.stream_gb == b.stream_gb
        return bool(getattr(k, knob))

    def _drop_base_copies(self, a: Anchor, k: Knobs, phases: dict[str, PhaseCost]) -> None:
        """Take the copies of the anchor's plugins the candidate no longer has (or changes) out of the phases."""
        for key, t in self._base_transfers(a).items():
            if self._kept(key, k, a.knobs):
                continue
            for direction in ("h2d_bytes", "d2h_bytes"):
                gone = getattr(t, direction) * (self.batch // k.micro) / max(self.batch // a.knobs.micro, 1)
                total = sum(getattr(phases[p], direction) for p in STEP_PHASES)
                if total <= 0:
                    continue
                for p in STEP_PHASES:
                    have = getattr(phases[p], direction)
                    setattr(phases[p], direction, max(int(have - gone * have / total), 0))

    def _trained(self, k: Knobs, a: Anchor) -> Trained:
        inv, b = self.inv, a.knobs
        elements, nbytes, params = inv.trained_elements, inv.trained_bytes, inv.trained_params
        if k.train != b.train:
            elements, nbytes = inv.lora_elements, inv.lora_elements * self.train_dtype_bytes
            params = max(params // 4, 1)
        if k.train_dtype != b.train_dtype and k.train == "full":
            nbytes //= 2
        t = Trained(device_elements=elements, device_bytes=nbytes, device_params=params)
        if k.stream_gb is not None and k.stream_gb >= 0 and k.train == "full":
            resident = a.module_weights(inv.trained)
            t.move_to_host(int(elements * self._streamed(k, resident) / max(resident, 1)))
        elif k.stream_gb is not None and k.stream_gb < 0 and k.train == "full":
            # the base's own stream: its streamed parameters already live on the host in the anchor
            host = [tr for key, tr in self._base_transfers(a).items() if key == _stream_key()]
            if host:
                t.move_to_host(int(elements * min(host[0].d2h_bytes / max(nbytes, 1), 1.0)))
        return t

    def estimate(self, k: Knobs) -> Estimate:
        peak, parts = self.peak(k)
        margin = CUDA_WORKSPACE_MARGIN_BYTES if self.on_cuda else 0
        return Estimate(knobs=k, peak_bytes=peak, required_bytes=peak + margin, step_time=self.step_time(k), parts=parts)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _stream_key() -> str:
    """The plugin key of the offload plugin that declares fit's ``stream_gb`` knob (whose copies a plan records)."""
    return f"offload/{offload_knobs().get('stream_gb', 'stream')}"
