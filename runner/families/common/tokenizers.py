"""Tokenizers of the built-in trainers: a diffusers folder's own, else tiny ones built offline.

Nothing here downloads: without a ``model.path`` folder the CLIP tokenizer runs over a minimal
byte-level vocabulary written to the temp dir, and T5's is ByT5's (bytes, no files).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import torch

from runner.errors import UserError


def _clip_vocab_files() -> str:
    """A folder with a minimal byte-level CLIP ``vocab.json`` and an empty ``merges.txt``.

    Files rather than an in-memory vocabulary because ``CLIPTokenizer.from_pretrained(folder)``
    is the one constructor that transformers 4.x (slow tokenizer) and 5.x (tokenizers backend)
    share. The folder is keyed by the content's hash under the temp dir and written to a
    private folder first, then renamed into place, so concurrent runs never see half a file.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    for s in symbols:
        vocab[s + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_text = json.dumps(vocab, ensure_ascii=False, sort_keys=True)
    merges_text = "#version: 0.2\n"
    digest = hashlib.sha256((vocab_text + merges_text).encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"runner-clip-bytes-{digest}")
    if not os.path.isfile(os.path.join(folder, "merges.txt")):
        staging = tempfile.mkdtemp(prefix="runner-clip-bytes-", dir=tempfile.gettempdir())
        with open(os.path.join(staging, "vocab.json"), "w", encoding="utf-8") as f:
            f.write(vocab_text)
        with open(os.path.join(staging, "merges.txt"), "w", encoding="utf-8") as f:
            f.write(merges_text)
        try:
            os.rename(staging, folder)
        except OSError:  # another process got there first: use its (identical) files
            shutil.rmtree(staging, ignore_errors=True)
    return folder


@functools.lru_cache(maxsize=4)
def clip_tokenizer(model_max_length: int = 77) -> Any:
    """A real ``CLIPTokenizer`` over a minimal byte-level vocabulary, built offline.

    Vocabulary: the 256 byte symbols of GPT-2's byte-to-unicode table, their ``</w>`` (end of
    word) forms, then ``<|startoftext|>`` = 512 and ``<|endoftext|>`` = 513; no merges, so every
    word is spelled byte by byte. Tokenization, specials, padding and truncation are the library's.
    """
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(_clip_vocab_files(), model_max_length=model_max_length, local_files_only=True)


@functools.lru_cache(maxsize=4)
def t5_tokenizer(model_max_length: int = 512) -> Any:
    """``ByT5Tokenizer`` (bytes, needs no files); ids < 384 fit both the tiny and the real T5 vocab."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(model_max_length=model_max_length)


def load_folder_tokenizer(folder: str, subfolder: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.join(folder, subfolder), local_files_only=True)
    except (OSError, ValueError) as e:
        where = os.path.join(folder, subfolder)
        raise UserError(f"Could not load a tokenizer from '{where}' (model.path): {e}.") from None


def tokenize(tokenizer: Any, texts: list[str], max_length: int, device: torch.device) -> torch.Tensor:
    """Token ids padded/truncated to ``max_length``, as diffusers pipelines tokenize prompts."""
    ids = tokenizer(
        list(texts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    return ids.to(device)


@functools.lru_cache(maxsize=4)
def qwen2_tokenizer(model_max_length: int = 1024) -> Any:
    """A real ``Qwen2Tokenizer`` over a minimal byte-level vocabulary, built offline (Qwen-Image).

    Vocabulary: the 256 byte symbols of GPT-2's byte-to-unicode table (Qwen2's own byte level),
    then ``<|endoftext|>`` = 256, ``<|im_start|>`` = 257 and ``<|im_end|>`` = 258, the chat
    template's specials; no merges, so every byte is a token. Pre-tokenization, specials and
    padding are the library's, so the prompt template and the count of its tokens that the
    pipeline drops behave as with the real tokenizer (only the counts differ).
    """
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from runner.families.qwen_image.architecture import TINY_QWEN_SPECIALS

    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    vocab.update(TINY_QWEN_SPECIALS)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


# The text Qwen3's chat template renders for one user turn with add_generation_prompt=True and
# enable_thinking=True (what ZImagePipeline asks for): no <think> block is added.
QWEN3_ONE_TURN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@functools.lru_cache(maxsize=4)
def qwen3_tokenizer(model_max_length: int = 1024) -> Any:
    """The byte-level tokenizer of :func:`qwen2_tokenizer` (a fresh instance, so the shared one is
    not changed) with a chat template rendering one user turn as Qwen3's does (Z-Image): the
    pipeline formats every prompt through ``apply_chat_template``, so the tiny model gets the same
    text around the caption as the real one."""
    tok = qwen2_tokenizer.__wrapped__(model_max_length)
    tok.chat_template = QWEN3_ONE_TURN_TEMPLATE  # also FLUX.2 klein's (Flux2KleinPipeline asks enable_thinking=False)
    return tok


# Mistral's chat layout as FLUX.2 dev's tokenizer renders Flux2Pipeline's messages (a system turn,
# then user turns whose content is a list of {"type": "text"} parts): [SYSTEM_PROMPT]..[/SYSTEM_PROMPT]
# then [INST]..[/INST] per user turn, after <s>.
MISTRAL_CHAT_TEMPLATE = (
    "{{ '<s>' }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' }}{% else %}{{ '[INST]' }}{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'system' %}{{ '[/SYSTEM_PROMPT]' }}{% else %}{{ '[/INST]' }}{% endif %}"
    "{% endfor %}"
)


@functools.lru_cache(maxsize=2)
def mistral_tokenizer(model_max_length: int = 1024) -> Any:
    """A byte-level tokenizer with Mistral's chat specials and template, built offline (FLUX.2 dev).

    ``Flux2Pipeline`` calls ``tokenizer.apply_chat_template(messages, padding="max_length", ...)`` on
    its processor; any tokenizer with a chat template answers that call, so the tiny model gets a
    ``Qwen2Tokenizer`` over the 256 byte symbols plus Mistral's specials
    (:data:`~runner.families.flux2.architecture.TINY_MISTRAL_SPECIALS`), ``<pad>`` for padding. Trade-off:
    the byte spelling and pre-tokenization are not Tekken's (only a real folder's tokenizer gives the
    real ids); what the pipeline does with the ids (template, padding, truncation) is the same.
    """
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from runner.families.flux2.architecture import TINY_MISTRAL_SPECIALS

    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    vocab.update(TINY_MISTRAL_SPECIALS)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=model_max_length, unk_token=None,
                         bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": [s for s in TINY_MISTRAL_SPECIALS if s.startswith("[")]})
    tok.chat_template = MISTRAL_CHAT_TEMPLATE
    return tok


@functools.lru_cache(maxsize=4)
def qwen2_vl_tokenizer(model_max_length: int = 1024) -> Any:
    """:func:`qwen2_tokenizer` plus Qwen2.5-VL's vision specials (Qwen-Image-Edit's prompt holds an image):
    ``<|image_pad|>`` = 259, ``<|video_pad|>`` = 260, ``<|vision_start|>`` = 261, ``<|vision_end|>`` = 262,
    the ids the tiny Qwen2.5-VL config gives them. A separate tokenizer so that Qwen-Image's stays as it was."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from runner.families.qwen_image.architecture import TINY_QWEN_SPECIALS, TINY_QWEN_VISION_SPECIALS

    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    vocab.update(TINY_QWEN_SPECIALS)
    vocab.update(TINY_QWEN_VISION_SPECIALS)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *TINY_QWEN_VISION_SPECIALS]})
    return tok
