"""LiveBytesTracker: exact byte counts, frees, views, peaks, phases, categories, FakeTensorMode."""
from __future__ import annotations

import gc
import json
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from runner.memory.live_bytes import LiveBytesTracker
from runner.memory.live_bytes_views import CATEGORIES


def test_torch_preserves_the_python_storage_object():
    # The design rests on this: the same Python storage object lives as long as the C++ storage,
    # so a weakref to it fires when the storage is freed, not when our reference is dropped.
    t = torch.ones(10)
    s1 = t.untyped_storage()
    fired = []
    weakref.finalize(s1, fired.append, 1)
    key = s1._cdata
    del s1
    gc.collect()
    assert not fired  # tensor still alive: the storage object survived losing our reference
    assert t.untyped_storage()._cdata == key
    del t
    assert fired == [1]  # freed at once, by refcount, without a GC pass


def test_allocate_and_free_exact_bytes():
    tr = LiveBytesTracker()
    with tr:
        a = torch.ones(1000)  # float32: 4000 bytes
        assert tr.current_bytes("cpu") == 4000
        b = torch.zeros(500, dtype=torch.float64)  # 4000 bytes
        assert tr.current_bytes("cpu") == 8000
        del a
        assert tr.current_bytes("cpu") == 4000
        del b
        assert tr.current_bytes("cpu") == 0
    assert tr.peak_bytes("cpu") == 8000  # the peak is kept after the frees


def test_views_do_not_double_count_and_keep_the_storage_alive():
    tr = LiveBytesTracker()
    with tr:
        a = torch.ones(1000)
        v = a.view(10, 100)
        w = a[10:20]
        u = v.t()
        assert tr.current_bytes() == 4000
        del a, v, w
        assert tr.current_bytes() == 4000  # u still holds the storage
        c = u * 2  # a real allocation
        assert tr.current_bytes() == 8000
        del u, c
    assert tr.current_bytes() == 0
    assert tr.peak_bytes() == 8000


def test_storages_born_uncounted_stay_uncounted_with_their_views():
    """``uncounted()``: what is born inside (the planner's FSDP-gathered weight casts) is never counted,
    nor its views or in-place writes later; what is born after it is, and the peak never saw it."""
    tr = LiveBytesTracker()
    with tr:
        a = torch.ones(1000)  # 4000 bytes, counted
        with tr.uncounted():
            b = a.to(torch.float64)  # 8000 bytes, not counted
        assert tr.current_bytes() == 4000
        v = b.view(10, 100).t()
        v.mul_(2)
        assert tr.current_bytes() == 4000
        c = b * 2  # a new storage from an uncounted one: counted
        assert tr.current_bytes() == 4000 + 8000
        del b, v, c
        d = torch.zeros(1000)  # may reuse b's address: counted
        assert tr.current_bytes() == 8000
        del a, d
    assert tr.current_bytes() == 0 and tr.peak_bytes() == 12000


def test_in_place_and_out_resize_are_counted():
    tr = LiveBytesTracker()
    with tr:
        a = torch.ones(100)
        a.add_(1)  # in place: same storage
        assert tr.current_bytes() == 400
        out = torch.empty(0)
        torch.add(a, a, out=out)  # out= resizes an existing storage from 0 to 400 bytes
        assert tr.current_bytes() == 800
    assert out.untyped_storage().nbytes() == 400


def test_track_preexisting_weights_and_inputs():
    lin = nn.Linear(10, 20)  # 200 + 20 float32 = 880 bytes
    x = torch.randn(4, 10)  # 160 bytes, not tracked: counted as "other" when first read
    tr = LiveBytesTracker()
    assert tr.track(lin, "weights") == 880
    assert tr.current_bytes() == 880
    with tr:
        y = lin(x)  # 4 x 20 float32 = 320 bytes
    cats = tr.category_bytes("cpu")
    assert cats["weights"] == 880
    assert cats["other"] == 160 + 320  # x, and y (born outside any phase)
    assert tr.current_bytes() == 880 + 160 + 320
    del y
    assert tr.current_bytes() == 880 + 160


def test_count_inputs_off_ignores_untracked_inputs():
    x = torch.randn(4, 10)
    tr = LiveBytesTracker(count_inputs=False)
    with tr:
        y = x * 2
    assert tr.current_bytes() == 160  # only y
    del y


def test_fake_tensor_mode_matmul_counts_meta_bytes_both_nestings():
    for order in ("fake_outside", "tracker_outside"):
        tr = LiveBytesTracker()
        fake = FakeTensorMode()
        outer, inner = (fake, tr) if order == "fake_outside" else (tr, fake)
        with outer, inner:
            a = torch.empty(100, 200, device="meta")  # 80 000 bytes
            b = torch.empty(200, 300, device="meta")  # 240 000 bytes
            base = tr.current_bytes("meta")
            c = a @ b  # 100 x 300 float32 = 120 000 bytes
            assert tr.current_bytes("meta") - base == 120_000, order
            del c
            assert tr.current_bytes("meta") == base, order
        assert base == 320_000, order
        assert tr.peak_bytes("meta") == 440_000, order
        assert tr.current_bytes("cpu") == 0, order
        del a, b


def test_fake_tensors_of_a_module_under_fake_mode():
    # The planner's use: build with FakeTensorMode, count weights with track(), run forward.
    with FakeTensorMode():
        lin = nn.Linear(64, 32)  # fake CPU tensors: (64*32 + 32) * 4 bytes
        x = torch.empty(8, 64)
        tr = LiveBytesTracker()
        tr.track(lin, "weights")
        with tr:
            with tr.phase("forward"):
                y = lin(x)
    snap = tr.snapshot()
    assert snap["devices"]["cpu"]["current_by_category"]["weights"] == (64 * 32 + 32) * 4
    assert snap["devices"]["cpu"]["current_by_category"]["activations"] == 8 * 32 * 4
    del y


def test_phase_peaks_and_temporaries():
    tr = LiveBytesTracker()
    with tr:
        with tr.phase("forward"):
            keep = torch.ones(1000)  # 4000, survives forward: activation
            tmp = torch.ones(2000)  # 8000, freed in forward: temporary
            del tmp
        with tr.phase("backward"):
            g = torch.ones(500)  # 2000, survives: "gradients" by default
            t2 = keep * 3  # 4000, freed in backward
            del t2
        with tr.phase("optimizer"):
            state = torch.zeros(250)  # 1000, survives: optimizer state
    snap = tr.snapshot()["devices"]["cpu"]
    assert snap["peak_by_phase"] == {"forward": 12000, "backward": 10000, "optimizer": 7000}
    assert snap["peak_bytes"] == 12000
    assert snap["peak_phase"] == "forward"
    # At the peak both forward tensors were alive; tmp died inside forward, so it is reported
    # as a temporary, not as an activation.
    assert snap["peak_by_category"]["activations"] == 4000
    assert snap["peak_by_category"]["temporaries"] == 8000
    assert snap["current_by_category"] == {
        "weights": 0, "gradients": 2000, "optimizer_state": 1000, "activations": 4000, "temporaries": 0, "other": 0
    }
    assert snap["temporaries_by_phase"] == {"forward": 8000, "backward": 4000}
    del keep, g, state


def test_training_step_categories():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(32, 100)
    tr = LiveBytesTracker()
    tr.track(model, "weights")
    with tr:
        with tr.phase("forward"):
            loss = model(x).pow(2).mean()
        after_forward = tr.category_bytes()["activations"]
        with tr.phase("backward"):
            loss.backward()
        assert tr.track_gradients(model) == nbytes
        with tr.phase("optimizer"):
            opt.step()
    cats = tr.category_bytes()
    assert cats["weights"] == nbytes
    assert cats["gradients"] == nbytes
    assert cats["optimizer_state"] == 2 * nbytes  # Adam's exp_avg and exp_avg_sq
    # Alive after forward: the ReLU output 32x100 (saved by ReLU's backward, which reads its
    # result, and by the second linear as its input), the second linear's output 32x10
    # (saved by pow) and the loss scalar. The first linear's output died in forward.
    assert after_forward == 32 * 100 * 4 + 32 * 10 * 4 + 4
    # activations are freed by backward
    assert cats["activations"] <= 4 + 4  # the loss scalar (and nothing else of size)
    snap = tr.report()
    json.dumps(snap)  # plain data
    assert set(snap["devices"]["cpu"]["peak_by_category"]) == set(CATEGORIES)
    assert snap["summary"] and snap["summary"][0].startswith("cpu: peak")


def test_module_hooks_attribute_retained_bytes():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    net = Net()  # the ModuleList is never called: its children get the hooks
    x = torch.randn(2, 8, requires_grad=True)
    tr = LiveBytesTracker()
    handles = tr.attach_module_hooks(net, depth=1)
    assert len(handles) == 4
    with tr:
        y = net(x)
    mods = tr.snapshot()["modules"]
    assert set(mods) == {"blocks.0", "blocks.1"}
    assert mods["blocks.0"]["calls"] == 1
    assert mods["blocks.0"]["live_bytes"] == 2 * 16 * 4  # its output, alive as the input of blocks.1
    assert mods["blocks.1"]["live_bytes"] == 2 * 4 * 4
    assert mods["blocks.0"]["retained_bytes"] >= 2 * 16 * 4
    tr.detach_module_hooks()
    with tr:
        net(x)
    assert tr.snapshot()["modules"]["blocks.0"]["calls"] == 1  # hooks removed
    del y


def test_module_context_manager_and_reset():
    tr = LiveBytesTracker()
    with tr:
        with tr.module("a"):
            keep = torch.ones(100)
            tmp = torch.ones(1000)
            del tmp
        st = tr.snapshot()["modules"]["a"]
        assert st == {"calls": 1, "allocated_bytes": 4400, "retained_bytes": 400, "max_increase_bytes": 4400, "live_bytes": 400}
        tr.reset_peaks()
        assert tr.peak_bytes() == 400
    del keep
    assert tr.current_bytes() == 0


def test_nested_phases_propagate_peaks():
    tr = LiveBytesTracker()
    with tr:
        with tr.phase("step"):
            with tr.phase("forward"):
                a = torch.ones(1000)
                del a
    peaks = tr.snapshot()["devices"]["cpu"]["peak_by_phase"]
    assert peaks == {"forward": 4000, "step": 4000}


def test_peak_breakdown_by_module_labels_tracked_and_born_bytes():
    # Weights labelled by track(module=...), activations by the module hook they were born in;
    # a relabel after the peak (gradients, as the planner does after backward) corrects the
    # breakdown at the peak, and a temporary keeps its module.
    net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # (8*16+16 + 16*4+4) * 4 = 848 bytes
    x = torch.randn(2, 8)
    tr = LiveBytesTracker(count_inputs=False)
    tr.track(net, "weights", module="net")
    tr.attach_module_hooks(net, depth=1, prefix="net")
    with tr:
        with tr.phase("forward"):
            y = net(x)  # net.0 output 2*16*4 = 128 (alive), net.1 output 2*4*4 = 32
            tmp = torch.ones(100)  # 400, born outside any module hook, dies in forward
            del tmp
        grad = torch.ones(10)  # 40, born after the peak
        tr.track(grad, "gradients", module="net")
    snap = tr.snapshot()["devices"]["cpu"]
    assert snap["peak_bytes"] == 848 + 128 + 32 + 400
    by_mod = snap["peak_by_module"]
    assert by_mod["net"] == {"weights": 848}
    assert by_mod["net.0"] == {"activations": 128}
    assert by_mod["net.1"] == {"activations": 32}
    assert by_mod["(none)"] == {"temporaries": 400}
    assert tr.module_bytes("cpu")["net"] == {"weights": 848, "gradients": 40}
    del y, grad
