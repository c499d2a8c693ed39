"""What every family shares: the trainer base (base.py, examples.py; flow.py and ddpm.py for the two loss
families), loading modules from a folder, hub id or single file (loading.py, hub.py, single_file.py,
single_file_load.py, safetensors_read.py), tokenizers, latents, cache keys, and the encoder and VAE
architecture tables several families share (model_configs.py).
Nothing here imports a family module at load time except single_file.py's layout table (FLUX.2's converter); tokenizers.py
reads the tiny Qwen and Mistral tokenizers' special tokens from their families' tables when it builds them.
"""
