"""FLUX.2 dev and klein: trainer.py, config.py (``trainer=flux2``, ``flux2_klein``), architecture.py (tiny and
full tables), sampling.py, single_file.py (BFL layout -> diffusers), comfy.py (ComfyUI LoRA keys).
"""
