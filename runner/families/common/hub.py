"""``model.path`` as a Hugging Face hub id, resolved from the local hub cache, never the network.

``model.path=stabilityai/stable-diffusion-xl-base-1.0`` (optionally ``@revision``: a branch, tag or
commit) is looked up in the hub cache with ``huggingface_hub.snapshot_download(local_files_only=True)``:
the snapshot folder it returns is a diffusers folder like any other. An id that is not cached
is a :class:`~runner.errors.UserError` with the command that fetches it: runs never download
(``HF_HUB_OFFLINE``), so a missing model is found in seconds, not after a timeout.

The cache folder is read from the environment when the id is resolved (``HF_HUB_CACHE``, then
``HUGGINGFACE_HUB_CACHE``, then ``HF_HOME/hub``, then huggingface_hub's default), because
huggingface_hub reads it once at import, before a test or a wrapper script may have set it.
"""
from __future__ import annotations

import os
import re

from runner.errors import UserError

# owner/name[@revision]: what the hub accepts as a repo id (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``("owner/name", revision or None)`` when ``text`` reads as a hub id, else None."""
    match = _HUB_ID.match(str(text))
    if match is None or str(text).startswith((".", "/", "~")):
        return None
    return match.group("repo"), match.group("rev")


def hub_cache_dir() -> str:
    """The hub cache folder, from the environment as it is now (see the module docstring)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return os.path.expanduser(env[var])
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def fetch_command(repo: str, revision: str | None = None, include: tuple[str, ...] = ()) -> str:
    """The command that puts ``repo`` into the local cache (huggingface_hub's CLI)."""
    rev = f" --revision {revision}" if revision else ""
    inc = " --include " + " ".join(f'"{p}"' for p in include) if include else ""
    return f"hf download {repo}{rev}{inc}"


def resolve_hub_id(text: str, repo: str, revision: str | None) -> str:
    """The local snapshot folder of ``repo`` at ``revision`` (default: main); a UserError when not cached."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError, a bad revision, an unreadable cache ...
        at = f" at revision {revision!r}" if revision else ""
        command = fetch_command(repo, revision)
        raise UserError(
            f"model.path={text!r} is neither a local folder nor a file, and the Hugging Face hub id {repo!r}{at} is not "
            f"in the local hub cache ({cache}); runs never download. Fetch it first with `{command}` (older "
            f"huggingface_hub: `huggingface-cli download {repo}{' --revision ' + revision if revision else ''}`; gated "
            f"models need `hf auth login` first), then run again, or give a diffusers folder or a .safetensors file. "
            f"({type(e).__name__})"
        ) from None


def cached_subfolder(repo: str, subfolder: str) -> str | None:
    """``<snapshot>/<subfolder>`` of ``repo`` (main) when the local hub cache has it, else None."""
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(repo, cache_dir=hub_cache_dir(), local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached at all
        return None
    folder = os.path.join(snapshot, subfolder)
    return folder if os.path.isdir(folder) else None
