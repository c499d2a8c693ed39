"""What every family shares: the trainer base (base.py, examples.py; flow.py and ddpm.py for the two loss
families), loading modules from a folder, hub id or single file (loading.py, hub.py, single_file.py,
single_file_load.py, safetensors_read.py), tokenizers, latents, cache keys, and the architecture tables
of the families whose encoders and VAEs are shared (model_configs.py: SDXL, FLUX.1, Chroma, SD1.5, SD3.5).
Nothing here imports a family module at load time except single_file.py's layout table (FLUX.2's converter); tokenizers.py
reads the tiny Qwen and Mistral tokenizers' special tokens from their families' tables when it builds them.
"""
