"""Architecture config dicts of the LTX-2 family (``trainer=ltx2``), in two sizes.

Plain data (accessors return deep copies). ``"full"``: LTX-2 19B as diffusers 0.42.1 documents it: the defaults of
``LTX2VideoTransformer3DModel`` (48 audio-video blocks, video width 4096, audio width 2048), ``LTX2TextConnectors``
(over Gemma-3-12B's 49 hidden states of width 3840), ``AutoencoderKLLTX2Video`` (128 latent channels, 32x space,
8x time) and ``AutoencoderKLLTX2Audio`` (8 latent channels over 64 mel bins, 4x time and mel), and Gemma-3-12B's
text tower (``Gemma3TextModel``: what the pipeline reads is its hidden states; no vision tower, no LM head).
``"tiny"`` keeps every structural feature the trainer relies on (both streams and their cross attention, the
connectors' masked per-layer normalisation, the causal video VAE, the causal audio VAE over stereo mel) at widths
of a few channels, as diffusers' own LTX-2 pipeline tests size them.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import _check_size
from runner.families.qwen_image.architecture import TINY_QWEN_VOCAB

_GEMMA3_12B = {  # google/gemma-3-12b text_config (the text tower LTX-2 reads)
    "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 1024, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
}
_GEMMA3_TINY = {
    "vocab_size": TINY_QWEN_VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16,
    "sliding_window": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 256, "eos_token_id": 256, "bos_token_id": 256,
}

_TRANSFORMER = {"num_layers": 48, "caption_channels": 3840}  # LTX2VideoTransformer3DModel's defaults: LTX-2 19B
_TRANSFORMER_TINY = {
    "in_channels": 4, "out_channels": 4, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 2,
    "attention_head_dim": 8, "cross_attention_dim": 16, "audio_in_channels": 8, "audio_out_channels": 8,
    "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
    "num_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
    "qk_norm": "rms_norm_across_heads", "caption_channels": 32, "rope_double_precision": False, "rope_type": "split",
    "vae_scale_factors": (2, 8, 8),
}

_CONNECTORS = {"caption_channels": 3840, "text_proj_in_factor": 49}  # LTX2TextConnectors' defaults: LTX-2
_CONNECTORS_TINY = {
    "caption_channels": 32, "text_proj_in_factor": 3,  # Gemma's 2 layers + the embeddings
    "video_connector_num_attention_heads": 2, "video_connector_attention_head_dim": 16,
    "video_connector_num_layers": 1, "video_connector_num_learnable_registers": None,
    "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 16,
    "audio_connector_num_layers": 1, "audio_connector_num_learnable_registers": None,
    "connector_rope_base_seq_len": 32, "rope_theta": 10000.0, "rope_double_precision": False,
    "causal_temporal_positioning": False, "rope_type": "split",
}

_VAE: dict[str, Any] = {}  # AutoencoderKLLTX2Video's defaults: LTX-2's video VAE
_VAE_TINY = {  # 8x space (4x4 patches, one spatiotemporal block), 2x time; causal encoder as the real one
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (8,),
    "decoder_block_out_channels": (8,), "layers_per_block": (1, 1), "decoder_layers_per_block": (1, 1),
    "spatio_temporal_scaling": (True,), "decoder_spatio_temporal_scaling": (True,),
    "decoder_inject_noise": (False, False), "down_block_types": ("LTX2VideoDownBlock3D",),
    "downsample_type": ("spatiotemporal",), "upsample_type": ("spatiotemporal",), "upsample_residual": (False,),
    "upsample_factor": (1,), "timestep_conditioning": False, "patch_size": 4, "patch_size_t": 1,
    "encoder_causal": True, "decoder_causal": False,
}

_AUDIO_VAE: dict[str, Any] = {}  # AutoencoderKLLTX2Audio's defaults: LTX-2's audio VAE (16 kHz, hop 160, 64 mel)
_AUDIO_VAE_TINY = {  # latent_channels x mel_bins / 4 = base_channels: the width of its latents statistics
    "base_channels": 8, "output_channels": 2, "ch_mult": (1, 2, 4), "num_res_blocks": 1, "attn_resolutions": None,
    "in_channels": 2, "resolution": 32, "latent_channels": 4, "norm_type": "pixel", "causality_axis": "height",
    "dropout": 0.0, "mid_block_add_attention": False, "sample_rate": 16000, "mel_hop_length": 160,
    "is_causal": True, "mel_bins": 8,
}

_VOCODER: dict[str, Any] = {}  # LTX2Vocoder's defaults: LTX-2's (mel to 24 kHz stereo); sampling and exports only
_VOCODER_TINY = {"in_channels": 16, "hidden_channels": 16, "out_channels": 2, "upsample_kernel_sizes": [4, 4],
                 "upsample_factors": [2, 2], "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]],
                 "leaky_relu_negative_slope": 0.1, "output_sampling_rate": 16000}  # in: 2 channels x 8 mel bins

_LTX2 = {
    "full": {"transformer": _TRANSFORMER, "connectors": _CONNECTORS, "vae": _VAE, "audio_vae": _AUDIO_VAE,
             "text_encoder": _GEMMA3_12B, "vocoder": _VOCODER},
    "tiny": {"transformer": _TRANSFORMER_TINY, "connectors": _CONNECTORS_TINY, "vae": _VAE_TINY,
             "audio_vae": _AUDIO_VAE_TINY, "text_encoder": _GEMMA3_TINY, "vocoder": _VOCODER_TINY},
}
LTX2_MAX_SEQUENCE_LENGTH = {"full": 1024, "tiny": 64}  # Gemma tokens per caption (left-padded), the pipeline's 1024
# The mel the audio VAE encodes (LTX-2's trainer: torchaudio MelSpectrogram, n_fft 1024, hop = mel_hop_length,
# Hann window, centred with reflect padding, magnitude, Slaney mel scale and norm, log clamped at 1e-5).
MEL_N_FFT = 1024


def ltx2_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the LTX-2 modules (transformer, connectors, vae, audio_vae, text_encoder) of one size."""
    _check_size(size)
    return copy.deepcopy(_LTX2[size])
