"""LTX-2 (runner/families/ltx2/trainer.py) against diffusers' ``LTX2Pipeline``, on the tiny model (CPU, offline).

* the text conditioning is the pipeline's ``encode_prompt`` then its connectors, bit for bit (captions of
  different lengths, left padding);
* the video and audio latents are the pipeline's ``prepare_latents`` / ``prepare_audio_latents`` of the VAEs'
  posterior means (normalised and packed as it does), bit for bit;
* ``predict_av`` is the pipeline's transformer call (both streams, positions, ``1000 t``), bit for bit;
* the loss is video + ``loss.audio_weight`` x audio; the key and ``data.audio`` are refused where invalid.
"""
from __future__ import annotations

import pytest
import torch
from accelerate.utils import set_seed

from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.families.ltx2.audio import log_mel, slaney_filterbank
from runner.families.ltx2.trainer import LTX2Trainer
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a cat", "a red bicycle leaning on a wall, oil painting"]
COMMON = ["trainer=ltx2", "train.device=cpu", "train.progress=false", "data.demo_size=2"]


def fresh(*overrides: str, frozen: bool = True):
    cfg = compose_config([*COMMON, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    assert isinstance(trainer, LTX2Trainer)
    set_seed(run.seed)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    for m in models.modules.values() if frozen else ():
        m.requires_grad_(False)
    return trainer, models


@pytest.fixture(scope="module")
def built():
    trainer, models = fresh()
    return trainer, models, trainer.pipeline(models)


def raw_batch(trainer, n=2):
    batch = trainer.example_raw_batch(n, "cpu")
    batch["caption"] = CAPTIONS[:n]
    batch["pixel_values"] = batch["pixel_values"].clamp(-1, 1)
    return batch


def test_text_conditioning_is_the_pipelines_prompt_and_connectors(built):
    trainer, models, pipe = built
    ours = trainer.encode_part(models, "text", raw_batch(trainer))
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu",
                                                max_sequence_length=trainer.max_sequence_length)
        video, audio, cmask = pipe.connectors(embeds, mask, padding_side="left")
    assert mask.sum(dim=1).tolist()[0] < mask.sum(dim=1).tolist()[1] < trainer.max_sequence_length
    assert bool(mask[:, -1].all())  # left padding: the last token is real
    assert torch.equal(ours["prompt_embeds"], video) and torch.equal(ours["audio_prompt_embeds"], audio)
    assert torch.equal(ours["prompt_attention_mask"], cmask)


def test_video_and_audio_latents_are_the_pipelines(built):
    trainer, models, pipe = built
    batch = raw_batch(trainer)
    video = trainer.encode_part(models, "latents", batch)
    audio = trainer.encode_part(models, "audio", batch)
    with torch.no_grad():
        vmean = models["vae"].encode(batch["pixel_values"]).latent_dist.mean
        expected_v = pipe.prepare_latents(latents=vmean, noise_scale=0.0, dtype=torch.float32, device="cpu")
        mel = trainer.mel(batch["audio"])
        amean = models["audio_vae"].encode(mel).latent_dist.mean
        expected_a = pipe.prepare_audio_latents(latents=amean, noise_scale=0.0, dtype=torch.float32, device="cpu")
    assert torch.equal(trainer.pack(video["latent_mean"]), expected_v)
    assert torch.equal(audio["audio_mean"], expected_a)
    # the pipeline's audio length for these frames at 24 fps: round(9 / 24 * 16000 / 160 / 4) latent frames
    assert amean.shape[2] == trainer.audio_frames() == round(9 / 24 * 25) and mel.shape[2] == 4 * amean.shape[2]
    assert tuple(expected_a.shape[1:]) == trainer.audio_shape()


def test_log_mel_frames_and_a_tone_in_its_band():
    rate, hop, n_fft, bins = 16000, 160, 1024, 64
    t = torch.arange(rate) / rate
    wave = torch.sin(2 * torch.pi * 1000.0 * t).expand(1, 2, -1)
    mel = log_mel(wave, rate, hop, bins, n_fft)
    assert mel.shape == (1, 2, rate // hop + 1, bins)
    fb = slaney_filterbank(n_fft, bins, rate)
    peak_bin = int(fb[round(1000 * n_fft / rate)].argmax())  # the filter that covers 1 kHz most
    assert int(mel[0, 0, 50].argmax()) == peak_bin
    assert torch.equal(mel[0, 0], mel[0, 1])


def test_predict_is_the_pipelines_transformer_call(built):
    trainer, models, pipe = built
    cond = trainer.encode_part(models, "text", raw_batch(trainer, 1))
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(kwargs=kwargs, out=out)

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler()  # unshifted: the second step is t = 0.5 exactly
    try:
        with torch.no_grad():
            pipe(prompt_embeds=torch.zeros(1, 4, 96), prompt_attention_mask=torch.ones(1, 4, dtype=torch.int64),
                 guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                 modality_scale=1.0, audio_modality_scale=1.0, num_inference_steps=2, height=64, width=64,
                 num_frames=9, frame_rate=24.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
        pipe.scheduler = scheduler
    kw = seen["kwargs"]
    assert float(kw["timestep"][0]) == 500.0
    batch = {"prompt_embeds": kw["encoder_hidden_states"], "audio_prompt_embeds": kw["audio_encoder_hidden_states"],
             "prompt_attention_mask": kw["encoder_attention_mask"], "sample_seed": torch.zeros(1, dtype=torch.int64)}
    video = pipe._unpack_latents(kw["hidden_states"], kw["num_frames"], kw["height"], kw["width"])
    with torch.no_grad():
        v, a = trainer.predict_av(models, video, kw["audio_hidden_states"], torch.tensor([0.5]), batch)
    assert torch.equal(v, seen["out"][0]) and torch.equal(a, seen["out"][1])
    assert cond["prompt_embeds"].shape[-1] == kw["encoder_hidden_states"].shape[-1]


def capture_second_call(models, pipe, **kw):
    """The transformer's kwargs and output at the pipeline's second step (unshifted scheduler: t = 0.5)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(kwargs=kwargs, out=out)

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    scheduler, pipe.scheduler = pipe.scheduler, FlowMatchEulerDiscreteScheduler()
    try:
        with torch.no_grad():
            pipe(prompt_embeds=torch.zeros(1, 4, 96), prompt_attention_mask=torch.ones(1, 4, dtype=torch.int64),
                 guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                 modality_scale=1.0, audio_modality_scale=1.0, num_inference_steps=2, height=64, width=64,
                 num_frames=9, frame_rate=24.0, output_type="latent", generator=torch.Generator().manual_seed(0), **kw)
    finally:
        handle.remove()
        pipe.scheduler = scheduler
    return seen["kwargs"], seen["out"]


def test_image_to_video_is_the_condition_pipelines_transformer_call(built):
    from PIL import Image

    from runner.families.common.loading import pipeline_class

    trainer, models, pipe = built
    i2v = pipeline_class("LTX2ImageToVideoPipeline")(**pipe.components)
    kw, out = capture_second_call(models, i2v, image=Image.new("RGB", (64, 64), (200, 30, 30)))
    batch = {"prompt_embeds": kw["encoder_hidden_states"], "audio_prompt_embeds": kw["audio_encoder_hidden_states"],
             "prompt_attention_mask": kw["encoder_attention_mask"], "sample_seed": torch.zeros(1, dtype=torch.int64)}
    video = i2v._unpack_latents(kw["hidden_states"], kw["num_frames"], kw["height"], kw["width"])
    frame = torch.zeros(1, 1, video.shape[2], 1, 1)
    frame[:, :, 0] = 1
    clean = trainer.pack(frame.expand(-1, -1, -1, *video.shape[3:]).contiguous()).squeeze(-1)
    assert torch.equal(kw["timestep"], 500.0 * (1 - clean))  # the first frame's tokens at 0, the rest at t
    with torch.no_grad():
        v, a = trainer.predict_av(models, video, kw["audio_hidden_states"], torch.tensor([0.5]), batch, None, clean)
    assert torch.equal(v, out[0]) and torch.equal(a, out[1])


def test_image_to_video_training_keeps_the_first_frame_out_of_the_loss(built):
    trainer, models, _ = built
    i2v = fresh("trainer.first_frame_p=1.0")[0]
    enc = trainer.encode(models, raw_batch(trainer))
    mask = i2v.first_frame_mask(enc["sample_seed"], enc["latents"])
    assert mask[:, 0, 0].eq(1).all() and mask[:, 0, 1:].eq(0).all()
    with torch.enable_grad():
        plain, cond = trainer.loss(models, enc), i2v.loss(models, enc)
        trainer.take_loss_parts(), i2v.take_loss_parts()
    assert torch.isfinite(cond) and float(cond) != float(plain)


def test_loss_is_video_plus_weighted_audio(built):
    trainer, models, _ = built
    enc = trainer.encode(models, raw_batch(trainer))
    weighted, plain = fresh("loss.audio_weight=0.25")[0], trainer
    with torch.enable_grad():
        base = plain.loss(models, enc)
        parts = plain.take_loss_parts()
        scaled = weighted.loss(models, enc)
    assert float(base) == pytest.approx(parts["video_loss"] + parts["audio_loss"], rel=1e-6)
    assert float(scaled) == pytest.approx(parts["video_loss"] + 0.25 * parts["audio_loss"], rel=1e-6)


@pytest.mark.parametrize("overrides, match", [
    (["loss.audio_weight=-1"], r"loss.audio_weight=-1.0 is not valid: it must be a number > 0"),
    (["loss.audio_weight=2", "data.audio=false"], r"data.audio=false trains video only"),
    (["data.frames=8"], r"data.frames=8 is not usable for LTX-2"),
    (["trainer.first_frame_p=2"], r"trainer.first_frame_p=2.0 is not valid: it is the share of samples"),
    (["trainer=wan", "data.audio=true"], r"data.audio=true: Wan has no audio stream"),
    (["trainer=wan", "loss.audio_weight=0.5"], r"loss.audio_weight=0.5: Wan has no audio loss"),
])
def test_bad_keys_are_one_line_user_errors(overrides, match):
    from runner.checks import check_config

    cfg = compose_config([*COMMON, *overrides])
    with pytest.raises(UserError, match=match) as err:
        check_config(cfg)
        build_trainer(cfg, resolve(cfg))
    assert "\n" not in str(err.value)


def test_data_audio_false_trains_video_only(built):
    trainer, models, _ = built
    video_only = fresh("data.audio=false")[0]
    assert "audio" not in video_only.encode_parts() and "audio" not in video_only.example_raw_batch(1, "cpu")
    batch = raw_batch(trainer)
    del batch["audio"]
    enc = video_only.encode(models, batch)
    assert "audio_latents" not in enc
    with torch.enable_grad():
        loss = video_only.loss(models, enc)
    assert torch.isfinite(loss) and video_only.take_loss_parts() == {}  # no audio_loss column
