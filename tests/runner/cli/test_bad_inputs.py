"""A corpus of bad inputs: each ends with a non-zero exit, no traceback and a message naming it.

Cases run in this process through the real entry point (tests/bad_input.py). Files the cases
need (broken images, captions, presets, checkpoints, model folders) are made by the fixture.
Faults of the running system (NaN, full or read-only disks, kills) are in test_faults.py,
cache damage in test_cache.py, mismatched resumes in test_resume.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bad_input import assert_clean_failure, run_main
from PIL import Image

ROOT = Path(__file__).resolve().parents[3]
FAST = ["train.progress=false", "train.preflight=false", "train.steps=1", "data.demo_size=2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    f: dict[str, Path] = {}

    def folder(name: str) -> Path:
        p = d / name
        p.mkdir()
        f[name] = p
        return p

    def image(path: Path, caption: bytes | None = b"a caption") -> None:
        Image.new("RGB", (64, 64), (200, 30, 30)).save(path)
        if caption is not None:
            path.with_suffix(".txt").write_bytes(caption)

    f["a_file"] = d / "a_file.txt"
    f["a_file"].write_text("not a folder")
    folder("empty")
    (folder("only_txt") / "a.txt").write_text("caption without image")
    (folder("not_image") / "fake.png").write_bytes(b"this is text, not a PNG")
    (f["not_image"] / "fake.txt").write_text("caption")
    (folder("zero_byte") / "empty.png").write_bytes(b"")
    (f["zero_byte"] / "empty.txt").write_text("caption")
    image(folder("latin1") / "cat.png", caption="caf\xe9".encode("latin-1"))
    image(folder("no_caption") / "uncaptioned.png", caption=None)
    image(folder("edit_no_reference") / "target.png")  # data.references=1: no control/target.png, no target_ref1.png
    image(folder("edit_bad_reference") / "target.png")
    (f["edit_bad_reference"] / "control").mkdir()
    (f["edit_bad_reference"] / "control" / "target.png").write_bytes(b"not a PNG")
    folder("model_dir_without_index")
    import torch
    from safetensors.torch import save_file

    f["flux_file"] = d / "flux1.safetensors"  # Black Forest Labs' layout, given to the SDXL trainer
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, str(f["flux_file"]))
    f["partial_sdxl"] = d / "sdxl_partial.safetensors"  # A1111 layout with most of the U-Net missing
    save_file({"model.diffusion_model.label_emb.0.0.weight": torch.zeros(2, 2)}, str(f["partial_sdxl"]))
    f["corrupt_weights"] = d / "model.safetensors"
    f["corrupt_weights"].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json")
    folder("no_checkpoint")
    ckpt = folder("bad_state") / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{not json")
    f["bad_state_ckpt"] = ckpt
    presets = folder("presets") / "preset"
    presets.mkdir()
    (presets / "bad_syntax.yaml").write_text("# @package _global_\nbudget_gb: 12\ntrain:\n  steps: [1, 2\n")
    (presets / "empty.yaml").write_text("")
    (presets / "bad_value.yaml").write_text("# @package _global_\ntrain:\n  steps: many\n")
    (presets / "unknown_key.yaml").write_text("# @package _global_\ntrain:\n  stepz: 3\n")
    for name, frames, caption in (("clip_no_caption", 5, None), ("short_clip", 3, b"a short clip")):
        clip = folder(name) / "clip1"
        clip.mkdir()
        for i in range(frames):
            image(clip / f"{i:04d}.png", caption=None)
        if caption is not None:
            (f[name] / "clip1.txt").write_bytes(caption)
    return f


# (id, arguments with {name} for a fixture path, words the message must contain)
CASES = [
    ("typo nested", ["train.stepz=3"], ["Did you mean 'steps'"]),
    ("typo top level", ["budgt_gb=12"], ["Did you mean 'budget_gb'"]),
    ("typo model key", ["model.lora_rnak=3"], ["Did you mean 'lora_rank'"]),
    ("misspelt plugin setting", ["offload.cache_dri=/x"], ["Did you mean offload.park.cache_dir?"]),
    ("typo plugin key", ["offload=park", "offload.park.cache_latentz=true"], ["cache_latents"]),
    ("plugin key not selected", ["offload.park.cache_dir=/tmp/x"], ["offload=park", "not selected"]),
    ("steps not a number", ["train.steps=abc"], ["train.steps"]),
    ("steps zero", ["train.steps=0"], ["train.steps=0"]),
    ("steps negative", ["train.steps=-1"], ["train.steps=-1"]),
    ("batch zero", ["train.batch_size=0"], ["train.batch_size=0"]),
    ("grad_accum does not divide", ["train.grad_accum=3"], ["train.grad_accum=3"]),
    ("warmup negative", ["train.lr_warmup_steps=-1"], ["train.lr_warmup_steps"]),
    ("save_every negative", ["train.save_every=-1"], ["train.save_every"]),
    ("keep_saved negative", ["train.keep_saved=-1"], ["train.keep_saved"]),
    ("seed negative", ["train.seed=-1"], ["train.seed=-1", "2**32"]),
    ("seed too large", ["train.seed=4294967296"], ["train.seed=4294967296"]),
    ("seed not a number", ["train.seed=x"], ["train.seed"]),
    ("unknown scheduler", ["train.lr_scheduler=cosin"], ["train.lr_scheduler='cosin'", "cosine"]),
    ("unknown nonfinite policy", ["train.on_nonfinite=maybe"], ["train.on_nonfinite", "skip, stop"]),
    ("nonfinite patience zero", ["train.nonfinite_patience=0"], ["train.nonfinite_patience"]),
    ("weight growth that stops every run", ["train.max_weight_growth=1"], ["train.max_weight_growth=1", "above 1"]),
    ("unknown precision", ["train.mixed_precision=fp8"], ["train.mixed_precision"]),
    ("unknown device", ["train.device=tpu"], ["train.device"]),
    ("max_grad_norm negative", ["train.max_grad_norm=-1"], ["train.max_grad_norm"]),
    ("bool not a bool", ["train.progress=maybe"], ["train.progress"]),
    ("unknown model size", ["model.size=huge"], ["model.size"]),
    ("unknown model dtype", ["model.dtype=int8"], ["model.dtype"]),
    ("unknown train mode", ["model.train=half"], ["model.train"]),
    ("unknown train dtype", ["model.train_dtype=float16"], ["model.train_dtype"]),
    ("lora rank zero", ["model.train=lora", "model.lora_rank=0"], ["model.lora_rank"]),
    ("bf16 weights in fp16 autocast", ["model.train_dtype=bfloat16", "train.mixed_precision=fp16"], ["conflicts"]),
    ("lr zero", ["optimizer.lr=0"], ["optimizer.lr"]),
    ("lr negative", ["optimizer.lr=-1"], ["optimizer.lr"]),
    ("unknown optimizer", ["optimizer=adamw9bit"], ["adamw9bit", "Valid names"]),
    ("fused_backward not a bool", ["optimizer.fused_backward=maybe"], ["optimizer.fused_backward"]),
    ("unknown device.name", ["device.name=rtx409"], ["device.name='rtx409'", "rtx4090"]),
    ("device spec missing", ["device.spec=/no/such/gpu.yaml"], ["device.spec", "not a file"]),
    ("device field not positive", ["device.name=rtx4090", "device.hbm_gbps=0"], ["hbm_gbps=0"]),
    ("device on a cpu run", ["device.name=rtx4090", "train.device=cpu"], ["train.device=cpu"]),
    ("unknown fit.allow", ["mode=fit", "budget_gb=12", "fit.allow=[lroa]"], ["lroa", "lora"]),
    ("fit without a budget", ["mode=fit", "train.device=cpu"], ["budget_gb", "device.name"]),
    ("fit.confirm zero", ["mode=fit", "budget_gb=12", "fit.confirm=0"], ["fit.confirm"]),
    ("fused backward with accumulation", ["optimizer.fused_backward=true", "train.batch_size=2", "train.grad_accum=2"],
     ["train.grad_accum=2", "fused_backward"]),
    ("fused backward with optimizer offload", ["optimizer.fused_backward=true", "offload=optimizer"],
     ["offload=optimizer", "Choose one"]),
    ("unknown offload plugin", ["offload=strem"], ["strem", "Valid names"]),
    ("unknown quantization", ["quantization=nf5"], ["nf5"]),
    ("unknown checkpoint plugin", ["checkpoint=blockz"], ["blockz"]),
    ("unknown tiling", ["tiling=vea"], ["vea"]),
    ("unknown allocator", ["allocator=defualt"], ["defualt"]),
    ("unknown trainer", ["trainer=sdxxl"], ["sdxxl"]),
    ("unknown preset", ["+preset=sdxl_24g"], ["sdxl_24g", "sdxl_24gb"]),
    ("list and add of one kind", ["offload=[park,stream]", "+offload=activations"], ["List them all in one"]),
    ("budget zero", ["budget_gb=0"], ["budget_gb"]),
    ("budget negative", ["budget_gb=-3"], ["budget_gb"]),
    ("unknown mode", ["mode=trian"], ["mode"]),
    ("resolution zero", ["data.resolution=0"], ["data.resolution"]),
    ("resolution not a number", ["data.resolution=abc"], ["data.resolution"]),
    ("unknown missing_caption policy", ["data.missing_caption=maybe"], ["data.missing_caption"]),
    ("demo size zero", ["data.demo_size=0"], ["data.demo_size"]),
    ("data path missing", ["data.path=/no/such/folder"], ["/no/such/folder"]),
    ("random_flip not a bool", ["data.random_flip=sometimes"], ["data.random_flip"]),
    ("progress lines every zero steps", ["log.every=0"], ["log.every=0"]),
    ("data path is a file", ["data.path={a_file}"], ["is a file"]),
    ("data folder empty", ["data.path={empty}"], ["contains no images"]),
    ("data folder of captions only", ["data.path={only_txt}"], ["contains no images"]),
    ("png that is not an image", ["data.path={not_image}"], ["fake.png"]),
    ("zero-byte image", ["data.path={zero_byte}"], ["empty.png"]),
    ("caption not UTF-8", ["data.path={latin1}"], ["cat.txt", "UTF-8"]),
    ("image without caption", ["data.path={no_caption}"], ["uncaptioned.png", "missing_caption=empty"]),
    ("edit target without its reference", ["trainer=flux_kontext", "data.references=1", "data.path={edit_no_reference}"],
     ["reference 1 of", "target.png", "control/target.png", "target_ref1.png"]),
    ("unreadable reference", ["trainer=flux_kontext", "data.references=1", "data.path={edit_bad_reference}"],
     ["cannot read image", "control/target.png"]),
    ("edit trainer without references", ["trainer=flux_kontext", "data.references=0"], ["data.references=0", "data.references=1"]),
    ("references for a family that takes none", ["data.references=1"], ["data.references=1", "not an edit model"]),
    ("caption dropout above 1", ["data.caption_dropout=1.5"], ["data.caption_dropout=1.5", "from 0 to 1"]),
    ("keep tokens negative", ["data.keep_tokens=-1"], ["data.keep_tokens=-1"]),
    ("caption extension without its dot", ["data.caption_ext=caption"], ["data.caption_ext='caption'",
                                                                          "data.caption_ext=.caption"]),
    ("shuffled tags with cached text", ["offload=park", "data.shuffle_tags=true"],
     ["data.shuffle_tags=true", "offload.park.cache_text=false"]),
    ("bucket step not a multiple of 8", ["data.buckets=true", "data.bucket_step=60"], ["data.bucket_step=60"]),
    ("bucket sides swapped", ["data.buckets=true", "data.bucket_min_side=128", "data.bucket_max_side=64"], ["swap them"]),
    ("typo in a data set", ["data.sets=[{{path:/tmp,repaets:2}}]"], ["Did you mean 'repeats'"]),
    ("data set without a path", ["data.sets=[{{repeats:2}}]"], ["data.sets[0].path is missing"]),
    ("weights on some data sets only", ["data.sets=[{{path:/tmp,weight:1}},{{path:/tmp}}]"], ["not on data.sets[1]"]),
    ("data path and data sets", ["data.path=/tmp", "data.sets=[{{path:/tmp}}]"], ["data.path and data.sets are both set"]),
    ("data set folder missing", ["data.sets=[{{path:/no/such/set}}]"], ["data.sets[0].path='/no/such/set' does not exist"]),
    ("hub id not in the local cache", ["model.path=nobody-here/no-such-model"], ["hf download nobody-here/no-such-model"]),
    ("single file of another family", ["model.path={flux_file}"], ["not a sdxl checkpoint", "Flux"]),
    ("original single file missing tensors", ["model.path={partial_sdxl}"], ["sdxl_partial.safetensors", "is the file complete"]),
    ("model path missing", ["model.path=/no/such/model"], ["model.path"]),
    ("model folder without model_index.json", ["model.path={model_dir_without_index}"], ["model.path"]),
    ("corrupt model weights", ["model.path={corrupt_weights}"], ["model.safetensors"]),
    ("resume path missing", ["train.resume=/no/such/run"], ["train.resume"]),
    ("resume folder without checkpoint", ["train.resume={no_checkpoint}"], ["holds no checkpoint"]),
    ("resume checkpoint corrupt", ["train.resume={bad_state_ckpt}"], ["state.json", "corrupt"]),
    ("trainer class not importable", ["trainer=custom", "trainer._target_=no_such_module.Trainer"], ["no_such_module"]),
    ("trainer constructor raises", ["trainer=custom", "trainer._target_=broken_trainers.RaisingInit"],
     ["RaisingInit", "resolution_typo"]),
    ("trainer missing methods", ["trainer=custom", "trainer._target_=broken_trainers.MissingMethods"],
     ["MissingMethods", "dataset"]),
    ("preset with a YAML syntax error", ["hydra.searchpath=[file://{presets}]", "+preset=bad_syntax"],
     ["bad_syntax.yaml:5:1"]),
    ("empty preset", ["hydra.searchpath=[file://{presets}]", "+preset=empty"], ["Preset 'empty'", "sets no keys"]),
    ("preset with a bad value", ["hydra.searchpath=[file://{presets}]", "+preset=bad_value"], ["train.steps"]),
    ("preset with an unknown key", ["hydra.searchpath=[file://{presets}]", "+preset=unknown_key"], ["stepz"]),
    ("typo loss key", ["loss.nosie_offset=0.1"], ["Did you mean 'noise_offset'"]),
    ("flux's moved timestep key", ["trainer=flux", "trainer.timestep_sampling=uniform"],
     ["trainer.timestep_sampling has moved", "loss.timestep_sampling"]),
    ("a preset's settings of a deselected plugin", ["+preset=flux_24gb_full", "offload=[park]"],
     ["offload.stream.device_budget_gb", "'~offload.stream'"]),
    ("unknown loss type", ["loss.type=hubr"], ["loss.type='hubr'", "huber"]),
    ("huber_c zero", ["loss.type=huber", "loss.huber_c=0"], ["loss.huber_c=0"]),
    ("noise offset negative", ["loss.noise_offset=-0.1"], ["loss.noise_offset=-0.1"]),
    ("min_snr_gamma negative", ["loss.min_snr_gamma=-5"], ["loss.min_snr_gamma=-5"]),
    ("min_snr_gamma not a number", ["loss.min_snr_gamma=high"], ["loss.min_snr_gamma"]),
    ("unknown timestep sampling", ["trainer=flux", "loss.timestep_sampling=logit_norm"], ["logit_normal"]),
    ("logit std zero", ["trainer=flux", "loss.logit_std=0"], ["loss.logit_std=0"]),
    ("unknown timestep shift", ["trainer=sd35", "loss.timestep_shift=dynamic"], ["loss.timestep_shift", "resolution"]),
    ("shift zero", ["trainer=sd35", "loss.shift=0"], ["loss.shift=0"]),
    ("noise offset on a flow-matching trainer", ["trainer=flux", "loss.noise_offset=0.1"],
     ["loss.noise_offset=0.1", "DDPM", "trainer=flux"]),
    ("timestep shift on a DDPM trainer", ["loss.timestep_shift=fixed"], ["loss.timestep_shift='fixed'", "trainer=sdxl"]),
    ("unknown sd15 variant", ["trainer=sd15", "trainer.variant=sd22"], ["trainer.variant 'sd22'", "sd21"]),
    ("unknown sd35 variant", ["trainer=sd35", "trainer.variant=larg"], ["trainer.variant 'larg'", "large"]),
    ("sd35 resolution not a multiple of 16", ["trainer=sd35", "data.resolution=72"], ["data.resolution=72", "16"]),
    ("kohya export of an sd35 lora", ["trainer=sd35", "model.train=lora", "export.lora_format=kohya"],
     ["export.lora_format=kohya", "diffusers"]),
    ("video frames zero", ["data.frames=0"], ["data.frames=0"]),
    ("video fps negative", ["data.fps=-2"], ["data.fps=-2"]),
    ("unknown frame sampling", ["data.frame_sampling=strat"], ["data.frame_sampling", "start"]),
    ("video width not a multiple of 8", ["data.width=100"], ["data.width=100"]),
    ("wan frames not 4k+1", ["trainer=wan", "data.frames=8"], ["data.frames=8", "4k+1"]),
    ("wan height not a multiple of 16", ["trainer=wan", "data.height=40"], ["data.height=40", "multiple of 16"]),
    ("unknown wan variant", ["trainer=wan", "trainer.variant=14B"], ["trainer.variant", "14b"]),
    ("typo wan key", ["trainer=wan", "trainer.varient=14b"], ["variant"]),
    ("unknown wan i2v variant", ["trainer=wan", "trainer.variant=i2v-14b"], ["trainer.variant", "i2v-2.1-14b"]),
    ("wan i2v a14b without an expert", ["trainer=wan", "trainer.variant=i2v-2.2-a14b"],
     ["trainer.experts=high or low", "i2v-2.2-a14b"]),
    ("wan clip folder without captions", ["trainer=wan", "data.path={clip_no_caption}"], ["clip1.txt"]),
    ("wan clip folder too short", ["trainer=wan", "data.frames=9", "data.path={short_clip}"],
     ["no clip is long enough", "data.frames=9"]),
    ("qwen text length too long", ["trainer=qwen_image", "trainer.max_sequence_length=4096"],
     ["trainer.max_sequence_length=4096"]),
    ("unparsable override", ["train.steps=[1,"], ["train.steps"]),
    ("ema key typo", ["ema.decya=0.9"], ["Did you mean 'decay'"]),
    ("ema decay one", ["ema.enabled=true", "ema.decay=1"], ["ema.decay=1"]),
    ("ema device typo", ["ema.enabled=true", "ema.device=cpuu"], ["ema.device='cpuu'", "cpu, device"]),
    ("ema every zero", ["ema.enabled=true", "ema.every=0"], ["ema.every=0"]),
    ("ema start negative", ["ema.enabled=true", "ema.start=-2"], ["ema.start=-2"]),
    ("ema start after the last step", ["ema.enabled=true", "ema.start=5"], ["ema.start=5", "train.steps=1"]),
    ("ema bf16 of fp32 weights", ["ema.enabled=true", "ema.dtype=bfloat16"], ["ema.dtype=bfloat16", "model.train_dtype"]),
    ("ema dtype typo", ["ema.enabled=true", "ema.dtype=fp32"], ["ema.dtype='fp32'", "float32"]),
    ("samples with ema off", ["sample.every=1", "sample.prompts=[a]", "sample.use_ema=true"], ["ema.enabled=true"]),
    ("val key typo", ["val.evrey=3"], ["Did you mean 'every'"]),
    ("val fraction above one", ["data.val_fraction=1.5"], ["data.val_fraction=1.5"]),
    ("val fraction and path", ["data.val_fraction=0.1", "data.val_path={empty}"], ["both set"]),
    ("val every without held-out data", ["val.every=5"], ["val.every=5", "data.val_fraction"]),
    ("val batch zero", ["data.val_fraction=0.5", "val.batch_size=0"], ["val.batch_size=0"]),
    ("val path missing", ["data.val_path=/no/such/val"], ["data.val_path='/no/such/val' does not exist"]),
    ("val path without images", ["data.val_path={only_txt}"], ["data.val_path", "contains no images"]),
    ("val fraction leaves nothing to train", ["data.val_fraction=0.9"], ["data.val_fraction=0.9", "none to train on"]),
    ("sweep with a bad value", ["-m", "train.steps=1,abc"], ["train.steps"]),
    ("unknown distribution", ["dist=fdsp"], ["Unknown distribution 'fdsp'", "fsdp"]),
    ("typo dist key", ["dist=fsdp", "dist.reshard_after_fwd=false"], ["Did you mean 'reshard_after_forward'"]),
    ("dist key of another option", ["dist=ddp", "dist.cpu_offload=true"], ["dist.cpu_offload"]),
    ("unknown sharding strategy", ["dist=fsdp", "dist.sharding_strategy=full"], ["dist.sharding_strategy='full'",
                                                                               "full_shard"]),
    ("world size zero", ["mode=plan", "dist=ddp", "dist.world_size=0"], ["dist.world_size=0"]),
    ("world size that is not launched", ["dist=ddp", "dist.world_size=2"], ["dist.world_size=2", "torchrun"]),
    ("several ranks but dist=none", ["mode=plan", "dist.world_size=2"], ["dist=none", "dist=ddp"]),
    ("global batch does not split over ranks", ["mode=plan", "dist=ddp", "dist.world_size=4", "train.batch_size=6"],
     ["train.batch_size=6", "4 ranks"]),
    ("fsdp with streamed blocks", ["mode=plan", "dist=fsdp", "dist.world_size=2", "offload=stream"],
     ["dist=fsdp and offload=stream", "dist.cpu_offload=true"]),
    ("fsdp with the host optimizer", ["mode=plan", "dist=fsdp", "dist.world_size=2", "offload=optimizer"],
     ["dist=fsdp and offload=optimizer"]),
    ("fsdp with an 8-bit optimizer", ["mode=plan", "dist=fsdp", "dist.world_size=2", "optimizer=adamw8bit"],
     ["dist=fsdp and optimizer=adamw8bit", "optimizer=adamw"]),
    ("fsdp with adafactor", ["mode=plan", "dist=fsdp", "dist.world_size=2", "optimizer=adafactor"],
     ["dist=fsdp and optimizer=adafactor"]),
    *[(f"fsdp with {name}", ["mode=plan", "dist=fsdp", "dist.world_size=2", f"optimizer={name}"],
       [f"dist=fsdp and optimizer={name}", f"dist=ddp with optimizer={name}"])
      for name in ("prodigy", "adamw_schedulefree", "lion", "lion8bit", "came")],
    ("prodigy stepped inside backward", ["optimizer=prodigy", "optimizer.fused_backward=true"],
     ["optimizer.fused_backward=true with optimizer=prodigy", "optimizer.fused_backward=false"]),
    ("schedule-free stepped in chunks", ["optimizer=adamw_schedulefree", "offload=optimizer",
                                         "offload.optimizer.step_on_host=false"],
     ["optimizer=adamw_schedulefree", "offload.optimizer.step_on_host=true"]),
    ("schedule-free with an EMA", ["optimizer=adamw_schedulefree", "ema.enabled=true"], ["ema.enabled=false"]),
    ("came with two betas", ["optimizer=came", "optimizer.betas=[0.9,0.999]"], ["optimizer.betas", "three numbers"]),
    ("cuda_sim budget below the workspace margin", ["train.device=cuda_sim", "budget_gb=0.01"],
     ["budget_gb=0.01", "kernel workspaces"]),
    ("cuda_sim with dist in one process", ["train.device=cuda_sim", "dist=ddp"], ["train.device=cuda_sim", "dist=ddp"]),
    ("fit headroom over the budget", ["mode=fit", "budget_gb=4", "fit.headroom_gb=5"], ["fit.headroom_gb=5"]),
    ("masks on a video preset, planned", ["+preset=wan_24gb", "mode=plan", "data.masks=true"],
     ["data.masks=true applies to image trainers"]),
    ("sample resolution off the VAE factor", ["sample.every=1", "sample.prompts=[a cat]", "sample.resolution=60"],
     ["sample.resolution=60", "multiple of 8"]),
    ("flux sample resolution off the packing", ["+preset=flux_24gb", "mode=plan", "sample.every=1",
                                                "sample.prompts=[a cat]", "sample.resolution=72"],
     ["sample.resolution=72", "multiple of 16"]),
    ("lion with a negative weight decay", ["optimizer=lion", "optimizer.weight_decay=-0.1"],
     ["optimizer.weight_decay=-0.1", "0 or more"]),
    ("came eps of the wrong length", ["optimizer=came", "optimizer.eps=[1e-30]"], ["optimizer.eps", "give 2 numbers"]),
    ("prodigy that cannot learn", ["optimizer=prodigy", "optimizer.d_coef=0"], ["optimizer.d_coef=0", "above 0"]),
    ("adafactor decay rate positive", ["optimizer=adafactor", "optimizer.decay_rate=0.8"],
     ["optimizer.decay_rate=0.8", "[-1, 0)"]),
    ("schedule-free negative warmup", ["optimizer=adamw_schedulefree", "optimizer.warmup_steps=-1"],
     ["optimizer.warmup_steps=-1", "0 or more"]),
    ("gradients offloaded before the ranks average them",
     ["mode=plan", "dist=ddp", "dist.world_size=2", "offload=optimizer", "offload.optimizer.offload_gradients=true"],
     ["offload_gradients=true", "dist=ddp"]),
    ("ddp with streamed blocks", ["mode=plan", "dist=ddp", "dist.world_size=2", "offload=stream"],
     ["dist=ddp and offload=stream"]),
    ("torchao host optimizer across ranks", ["mode=plan", "dist=ddp", "dist.world_size=2", "offload=optimizer",
                                             "offload.optimizer.implementation=torchao"], ["implementation=torchao"]),
    ("hybrid shard planned without ranks per node",
     ["mode=plan", "dist=fsdp", "dist.world_size=4", "dist.sharding_strategy=hybrid_shard"], ["dist.ranks_per_node"]),
    ("hybrid shard over ranks that do not divide",
     ["mode=plan", "dist=fsdp", "dist.world_size=4", "dist.sharding_strategy=hybrid_shard", "dist.ranks_per_node=3"],
     ["dist.ranks_per_node=3"]),
    ("unknown interconnect", ["mode=plan", "dist=fsdp", "dist.world_size=2", "dist.interconnect=nvlink9"],
     ["dist.interconnect='nvlink9'", "nvlink4"]),
    ("no ranks on a node", ["mode=plan", "dist=ddp", "dist.world_size=2", "dist.ranks_per_node=0"],
     ["dist.ranks_per_node=0", ">= 1"]),
]


@pytest.mark.parametrize("args, needles", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_fails_cleanly(files, tmp_path, args, needles):
    args = [a.format(**files) for a in args]
    sys.path.insert(0, str(ROOT / "tests" / "assets"))
    try:
        result = run_main([*FAST, *args, f"output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'h'}",
                           f"hydra.sweep.dir={tmp_path / 's'}"])
    finally:
        sys.path.remove(str(ROOT / "tests" / "assets"))
    assert_clean_failure(result, *needles)


@pytest.mark.parametrize("sub, needle", [("", "is a file"), ("/run", "which is a file")])
def test_an_output_dir_that_is_or_lies_under_a_file_is_refused(files, tmp_path, sub, needle):
    result = run_main([*FAST, f"output_dir={files['a_file']}{sub}", f"hydra.run.dir={tmp_path / 'h'}"])
    assert_clean_failure(result, f"output_dir={files['a_file']}{sub}", needle)


def test_the_corpus_is_large():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


def test_the_scheduler_list_matches_diffusers():
    from diffusers.optimization import SchedulerType

    from runner.config import LR_SCHEDULERS

    assert sorted(LR_SCHEDULERS) == sorted(s.value for s in SchedulerType)
