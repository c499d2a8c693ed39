"""dist=none|ddp|fsdp in one process: the config group, what the resolved run records, the shards of
the global batch, the strict resume across world sizes, and the one run directory of many ranks.

The multi-process runs themselves are in test_dist_training.py; bad values are in the corpus of
tests/runner/cli/test_bad_inputs.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from runner.distributed.config import DistSpec
from runner.distributed.launch import START_TIME_ENV, process_world, runner_now
from runner.distributed.runtime import DataParallel, cpu_offload_policy
from runner.errors import UserError
from runner.cli.listing import format_plugin_list
from runner.resolved import resolve
from runner.state.resume import check_unchanged, merge_overrides
from runner.cli.compose import compose_config
from runner.checks import resolve_for_mode, validate


@pytest.fixture
def launched(monkeypatch):
    """This process as rank ``rank`` of ``world`` launched by torchrun (its environment only)."""

    def launch(world: int, rank: int, local_world: int | None = None) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % (local_world or world)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world or world))

    return launch


def test_the_group_composes_and_lists_its_keys_with_defaults():
    cfg = compose_config(["dist=fsdp"])
    assert cfg.dist.name == "fsdp" and cfg.dist.reshard_after_forward is True and cfg.dist.cpu_offload is False
    assert compose_config([]).dist.name == "none"
    text = format_plugin_list()
    for line in ("dist.reshard_after_forward: bool = True", "dist.cpu_offload: bool = False",
                 "dist.sharding_strategy: str = 'full_shard'", "dist.bucket_mb: float = 25.0"):
        assert line in text


def test_the_resolved_run_records_rank_world_size_and_the_rank_share_of_the_batch(launched):
    launched(world=4, rank=3, local_world=2)
    cfg = compose_config(["dist=fsdp", "train.batch_size=8", "train.grad_accum=2", "dist.sharding_strategy=hybrid_shard"])
    validate(cfg)
    run = resolve(cfg)
    assert run.dist == DistSpec(name="fsdp", world_size=4, rank=3, local_rank=1, shard_size=2, ranks_per_node=2)
    assert (run.batch_size, run.rank_batch, run.micro_batch) == (8, 2, 1)
    assert "rank 3 of 4" in run.describe() and "global batch 8, 2 per rank as 2 x 1" in run.describe()


def test_one_process_keeps_every_figure_of_a_run_without_dist():
    plain, ddp = resolve(compose_config([])), resolve(compose_config(["dist=ddp"]))
    assert not ddp.dist.active and ddp.micro_batch == plain.micro_batch == 2 and ddp.rank_batch == 2
    assert ddp.describe() == plain.describe()


def test_a_plan_is_for_one_rank_of_dist_world_size_without_a_launcher():
    cfg = compose_config(["mode=plan", "dist=ddp", "dist.world_size=4", "train.batch_size=8"])
    validate(cfg)
    run = resolve_for_mode(cfg)
    assert run.dist.world_size == 4 and run.dist.rank == 0 and run.micro_batch == 2 and run.simulate
    assert run.dist.ranks_per_node == 4 and run.dist.nodes == 1  # mode=plan: min(world_size, 8) per node
    cfg = compose_config(["mode=plan", "dist=ddp", "dist.world_size=16", "train.batch_size=16"])
    validate(cfg)
    assert resolve_for_mode(cfg).dist.nodes == 2


@pytest.mark.parametrize("extra", [["ema.enabled=true"], ["data.val_fraction=0.25"],
                                   ["optimizer.fused_backward=true", "model.train=full"]],
                         ids=["ema", "validation", "fused_backward"])
def test_ddp_takes_the_ema_the_validation_loss_and_fused_backward(extra):
    """Every DDP rank holds the whole trained module: the EMA and the held-out loss run as in one process,
    and fused backward averages each gradient in its hook (the 2-rank runs: test_dist_training.py)."""
    validate(compose_config(["mode=plan", "dist=ddp", "dist.world_size=2", "train.batch_size=4", *extra]))


@pytest.mark.parametrize("extra", [["ema.enabled=true"], ["data.val_fraction=0.25"],
                                   ["optimizer.fused_backward=true", "model.train=full"]],
                         ids=["ema", "validation", "fused_backward"])
def test_fsdp_takes_the_ema_the_validation_loss_and_fused_backward(extra):
    """Each FSDP rank keeps the EMA of its own shards, every rank runs the held-out forwards together
    (test_fsdp_features.py), and fused backward steps each shard in the hook FSDP2 calls after the
    reduce-scatter (test_dist_training.py): none is refused any more."""
    validate(compose_config(["mode=plan", "dist=fsdp", "dist.world_size=2", "train.batch_size=4", *extra]))


def test_every_conflict_with_dist_is_listed_at_once():
    """A dist=fsdp command that breaks three rules learns all three from one refusal, each with its fix."""
    cfg = compose_config(["mode=plan", "dist=fsdp", "dist.world_size=2", "train.batch_size=3",
                          "offload=[park,stream]", "optimizer=adamw8bit"])
    with pytest.raises(UserError) as e:
        validate(cfg)
    text = str(e.value)
    assert text.startswith("3 settings cannot be combined with dist=fsdp as given; all of them:"), text
    for n, needle in enumerate(["train.batch_size=3 does not split evenly", "dist=fsdp and offload=stream cannot be combined",
                                "optimizer=adamw8bit cannot be combined"], 1):
        assert f"\n  {n}. " in text and needle in text.split(f"\n  {n}. ")[1].split("\n")[0], (n, text)


def test_fsdp_gathers_in_the_autocast_dtype_only_over_float32_trained_weights():
    """ResolvedRun.fsdp_param_dtype, decided once: the autocast dtype under dist=fsdp on several ranks with
    float32 trained weights; None where FSDP2 has nothing to cast or was told not to."""
    gpu = ["mode=plan", "train.device=cuda", "train.mixed_precision=bf16"]

    def gathered(*overrides: str) -> torch.dtype | None:
        return resolve_for_mode(compose_config([*gpu, *overrides])).fsdp_param_dtype

    assert gathered("dist=fsdp", "dist.world_size=2") == torch.bfloat16
    assert gathered("dist=fsdp", "dist.world_size=2", "train.mixed_precision=fp16") == torch.float16
    assert gathered("dist=fsdp", "dist.world_size=2", "dist.mixed_precision=false") is None
    assert gathered("dist=fsdp", "dist.world_size=2", "model.train_dtype=bfloat16") is None
    assert gathered("dist=fsdp", "dist.world_size=2", "train.mixed_precision=no") is None
    assert gathered("dist=ddp", "dist.world_size=2") is None and gathered("dist=fsdp") is None


def test_the_issue_29_command_learns_batch_stream_and_adafactor_from_one_refusal():
    """Issue 29's Flux command before its fixes: a global batch of 2 over 4 ranks, offload=stream and
    Adafactor (the preset's) under dist=fsdp. It took three commands to learn all three; one refusal
    names them, each once, with its fix."""
    cfg = compose_config(["+preset=flux_24gb_full", "mode=plan", "model.size=full", "dist=fsdp", "dist.world_size=4"])
    with pytest.raises(UserError) as e:
        validate(cfg)
    text = str(e.value)
    assert text.startswith("3 settings cannot be combined with dist=fsdp as given; all of them:"), text
    for needle, fix in [("train.batch_size=2 does not split evenly over 4 ranks", "train.batch_size=4"),
                        ("dist=fsdp and offload=stream cannot be combined", "dist.cpu_offload=true"),
                        ("dist=fsdp and optimizer=adafactor cannot be combined", "optimizer=adamw")]:
        line = next(x for x in text.splitlines() if needle in x)
        assert fix in line and text.count(needle) == 1, (needle, text)
    assert "not FSDP's sharded parameters" not in text  # the Adafactor reason reads as one sentence


def test_fsdp_cpu_offload_pins_the_host_shards_only_for_a_cuda_like_target():
    """``dist.cpu_offload=true``: FSDP2 pins host shards by default, which a CPU-only torch cannot do
    (a traceback before step 1 on a CPU run). The policy pins for a CUDA-like device only, as park does."""
    from runner.side_streams import SIM_DEVICE

    assert cpu_offload_policy(torch.device("cpu")).pin_memory is False
    assert cpu_offload_policy(SIM_DEVICE).pin_memory is True  # the simulated card: pinning is simulated
    if torch.cuda.is_available():
        assert cpu_offload_policy(torch.device("cuda", 0)).pin_memory is True


def test_a_launch_with_another_world_size_than_configured_is_refused(launched):
    launched(world=2, rank=0)
    with pytest.raises(UserError, match=r"dist.world_size=4, but this run was launched with 2 processes"):
        resolve(compose_config(["dist=ddp", "dist.world_size=4"]))
    with pytest.raises(UserError, match="dist=none"):
        resolve(compose_config([]))


def test_submitit_tasks_become_ranks(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RUNNER_LAUNCHER"):
        monkeypatch.setenv(key, "x")  # recorded as absent before: restored so, whatever submitit exports
        monkeypatch.delenv(key)
    env = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "123", "SUBMITIT_LOCAL_NTASKS": "2",
           "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pytest.importorskip("submitit")
    world = process_world()
    assert (world.world_size, world.rank, world.local_rank, world.launcher) == (2, 1, 1, "submitit")
    assert os.environ["MASTER_PORT"] and os.environ["WORLD_SIZE"] == "2"


def _shards(world: int, batch: int, step: int) -> list[tuple[list[int], list[int]]]:
    from runner.data.order import SampleOrder

    order = SampleOrder(16, seed=7)
    start = step * batch
    out = []
    for rank in range(world):
        spec = DistSpec(name="ddp", world_size=world, rank=rank)
        shard = DataParallel.shard(type("R", (), {"spec": spec})(), order.indices(start, batch),
                                   order.sample_seeds(start, batch))
        out.append((shard[0], shard[1].tolist()))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_world_size_consumes_the_same_samples_with_the_same_seeds_per_step(world):
    for step in range(5):  # across an epoch boundary (16 samples, 8 per step)
        one = _shards(1, 8, step)[0]
        parts = _shards(world, 8, step)
        assert [i for idx, _ in parts for i in idx] == one[0]
        assert [s for _, seeds in parts for s in seeds] == one[1]
        assert all(len(idx) == 8 // world for idx, _ in parts)


def test_strict_resume_takes_the_world_size_of_this_launch_not_the_checkpoints():
    saved = compose_config(["dist=fsdp", "mode=plan", "dist.world_size=2"])
    from omegaconf import OmegaConf

    overrides = merge_overrides(["dist=fsdp", "dist.world_size=2"], ["train.resume=/x", "dist.world_size=4"])
    assert overrides == ["dist=fsdp", "train.resume=/x", "dist.world_size=4"]
    assert merge_overrides(["dist=fsdp", "dist.world_size=2"], ["train.resume=/x"]) == ["dist=fsdp", "train.resume=/x"]
    now = compose_config(["dist=ddp", "mode=plan", "dist.world_size=4"])
    allowed = check_unchanged(OmegaConf.to_container(saved, resolve=False), now, "config.yaml")
    assert {k for k, _, _ in allowed} >= {"dist.name"}  # a change of distribution is allowed, and listed


def test_ranks_agree_on_one_run_directory(monkeypatch):
    monkeypatch.setenv(START_TIME_ENV, "1700000000.5")
    assert runner_now("%Y-%m-%d %H-%M-%S") == __import__("datetime").datetime.fromtimestamp(1700000000.5).strftime(
        "%Y-%m-%d %H-%M-%S")
    from hydra import compose, initialize_config_dir

    from runner.files import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    from omegaconf import OmegaConf

    stamp = __import__("datetime").datetime.fromtimestamp(1700000000.5)
    assert OmegaConf.select(cfg, "hydra.run.dir") == stamp.strftime("outputs/%Y-%m-%d/%H-%M-%S")
    assert OmegaConf.select(cfg, "hydra.sweep.dir") == stamp.strftime("multirun/%Y-%m-%d/%H-%M-%S")


def test_gradient_sync_forward_is_zero_and_touches_every_trained_parameter():
    from runner.distributed.runtime import GradientSync

    m = torch.nn.Linear(3, 2)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    holder = GradientSync({"m": m, "f": frozen})
    out = holder()
    assert out.item() == 0.0
    out.backward()
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
    assert all(p.grad is None for p in frozen.parameters())


def test_zz_no_launch_environment_leaks_out_of_these_tests():
    assert "WORLD_SIZE" not in os.environ and "RUNNER_LAUNCHER" not in os.environ


def _rank0_only(*extra: str) -> tuple[frozenset[str], str]:
    from runner.parts import build_trainer
    from runner.distributed.loading import rank0_only_modules

    cfg = compose_config(["mode=plan", "dist=ddp", "dist.world_size=2", "train.batch_size=4", *extra])
    checked = validate(cfg)
    return rank0_only_modules(cfg, build_trainer(cfg, checked.run), checked.plugins, checked.run.dist)


def test_only_rank_0_loads_the_modules_park_drops_once_it_filled_the_cache():
    """Issue 29: under offload=park rank 0 fills the encoder cache while the others wait, and the others
    drop the modules that compute only cached outputs without calling them: they are not loaded there.
    Kept on every rank where a rank does call them (sample prompts, data.val_path samples, encoded on
    every rank before park runs), where a node may fill its own cache folder (several nodes), where
    another plugin names the module, or where park caches nothing."""
    names, why = _rank0_only("offload=park")
    assert names == {"text_encoder", "text_encoder_2", "vae"} and "rank 0 only" in why
    assert _rank0_only("offload=park", "offload.park.cache_latents=false")[0] == {"text_encoder", "text_encoder_2"}
    assert _rank0_only("offload=park", "quantization=nf4", "quantization.nf4.modules=[text_encoder_2]",
                       "model.train=lora")[0] == {"text_encoder", "vae"}
    for extra, said in ((["sample.every=1", "sample.prompts=[a red cube]"], "sample.every is set"),
                        (["dist.ranks_per_node=1"], "2 nodes")):
        names, why = _rank0_only("offload=park", *extra)
        assert names == frozenset() and said in why and "loaded on every rank" in why, why
    assert _rank0_only() == (frozenset(), "")  # no park: every rank encodes its own batches
    assert _rank0_only("offload=park", "dist=none", "dist.world_size=1")[0] == frozenset()


def test_a_collective_whose_partner_stopped_first_is_told_apart_from_a_bug(monkeypatch):
    """runner/cli/launch.py prints one line, not a traceback, for a rank that failed inside a collective
    because another rank stopped first (gloo's and NCCL's messages, torch's DistNetworkError); an
    ordinary error stays a bug, and one process never has a partner to lose."""
    import torch.distributed as dist

    from runner.distributed.launch import lost_peer

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:45187. This is "
                        "typically caused by a remote worker crashing.")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not lost_peer(gloo)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert lost_peer(gloo) and lost_peer(dist.DistNetworkError("socket closed"))
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) and not lost_peer(ValueError("x"))
