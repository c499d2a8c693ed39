"""GPU check of allocator + tracker (run on the device machine)."""
import logging, os, sys, json
sys.path.insert(0, os.getcwd())
logging.basicConfig(level=logging.INFO)
import torch
from plugins.allocator import AllocatorConfig, apply_allocator_settings
os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
print("initialized before:", torch.cuda.is_initialized())
r = apply_allocator_settings(AllocatorConfig(cap_to_budget=True, max_split_size_mb=256), 8.0, "cuda")
print(r)
print("backend settings:", torch.cuda.memory._get_current_allocator() if hasattr(torch.cuda.memory, "_get_current_allocator") else None)
x = torch.empty(1024, device="cuda")
snap = torch.cuda.memory._snapshot() if hasattr(torch.cuda.memory, "_snapshot") else {}
segs = snap.get("segments", [])
print("segment types:", {s.get("segment_type") for s in segs}, "expandable:", [s.get("is_expandable") for s in segs][:3])
print("tf32:", torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.allow_tf32)
try:
    torch.empty(int(9 * 2**30), dtype=torch.uint8, device="cuda")
    print("cap NOT enforced")
except torch.OutOfMemoryError as e:
    print("cap enforced: OOM at 9 GiB")
# tracker vs memory_allocated
from runner.memory.tracker import LiveBytesTracker
del x
torch.cuda.empty_cache()
base = torch.cuda.memory_allocated()
tr = LiveBytesTracker()
m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
tr.track(m)
inp = torch.randn(256, 1024, device="cuda")
with tr:
    with tr.phase("forward"):
        loss = m(inp).pow(2).mean()
    fwd_tr = tr.current_bytes("cuda:0"); fwd_real = torch.cuda.memory_allocated() - base
    with tr.phase("backward"):
        loss.backward()
    tr.track_gradients(m)
print("after forward tracker/memory_allocated:", fwd_tr, fwd_real)
print("after backward tracker/memory_allocated:", tr.current_bytes("cuda:0"), torch.cuda.memory_allocated() - base)
print(json.dumps(tr.report()["summary"]))
# checkpoint on cuda
from plugins.checkpoint import apply_activation_checkpointing, find_repeated_blocks
class Net(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)) for _ in range(8)])
    def forward(s, x):
        for b in s.blocks: x = x + b(x)
        return x
net = Net().cuda()
x = torch.randn(2048, 1024, device="cuda")
def peak():
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); b = torch.cuda.memory_allocated()
    net(x).pow(2).mean().backward(); torch.cuda.synchronize()
    g = [p.grad.clone() for p in net.parameters()]; net.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - b, g
p0, g0 = peak()
apply_activation_checkpointing(find_repeated_blocks(net))
p1, g1 = peak()
print("cuda peak bytes above start, no ckpt / ckpt:", p0, p1, "grads equal:", all(torch.equal(a, b) for a, b in zip(g0, g1)))
