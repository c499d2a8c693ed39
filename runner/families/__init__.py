"""Built-in trainers. Importing this package registers ``trainer=sdxl``, ``flux``, ``flux_kontext``, ``flux2`` (and ``flux2_klein``),
``chroma``, ``sd15``, ``sd35``, ``qwen_image``, ``qwen_image_edit``, ``wan`` (and its Wan 2.2 options ``wan22_a14b``,
``wan22_5b``), ``z_image``, ``lumina2``, ``hidream``, ``qwen_image21``, ``krea2``, ``hunyuan_video15``
(HunyuanVideo 1.5 text-to-video) and ``ltx2`` (LTX-2, audio and video).

Each family is a folder, ``runner/families/<family>/``, whose ``config.py`` holds its option schema and its
``OPTIONS`` (name, class path, description, loss objective, native resolution); one ``register_family`` line
below registers them: the trainer modules import torch and diffusers, and are imported only when a run
builds the trainer (``loss.*`` options are checked against the registered objective before that).
"""
import importlib

from runner.registry import register_trainer


def register_family(family: str) -> None:
    """Register the trainer options of ``runner/families/<family>/config.py`` (torch-free: the class loads on build)."""
    for e in importlib.import_module(f"runner.families.{family}.config").OPTIONS:
        register_trainer(e.name, e.target, e.config, e.description, e.native_resolution, e.objective)


register_family("sdxl")
register_family("flux")
register_family("flux_kontext")
register_family("flux2")
register_family("chroma")
register_family("sd15")
register_family("sd35")
register_family("qwen_image")
register_family("qwen_image_edit")
register_family("wan")
register_family("z_image")
register_family("lumina2")
register_family("hidream")
register_family("qwen_image21")
register_family("krea2")
register_family("hunyuan_video15")
register_family("ltx2")
