"""Per-visit caption augmentation: caption dropout and tag shuffling (kohya's semantics).

``data.caption_dropout=p`` trains a visit with the empty caption with probability ``p`` (what
classifier-free guidance needs); ``data.shuffle_tags=true`` treats a caption as comma-separated
tags and shuffles them per visit, keeping the first ``data.keep_tokens`` tags in place (a
trigger word first, say). Order of operations, as in kohya sd-scripts' ``process_caption``:
dropout first (a dropped caption is ``""``), otherwise split on ``,``, strip each tag, shuffle
the tags after the first ``keep_tokens``, join with ``", "``. Unlike kohya, empty tags (a
trailing comma, ``"a,,b"``) are dropped rather than shuffled in as blanks. ``keep_tokens``
without ``shuffle_tags`` changes nothing (kohya: the same).

Randomness comes from the visit's ``sample_seed`` (its global position in the run, see
:mod:`runner.data.order`), hashed with :func:`runner.data.images._mix`, never from a global
RNG: a visit gets the same caption after a resume and in any micro-batch split, and two visits
of one image get independent draws. The draws are our own splitmix64 hash (not ``random`` or
``torch.randperm``) so that the caption of a visit is a documented function of its seed that
no library upgrade changes.

The encoder cache (offload=park) and these options: a dropped caption is one more caption text
(``""``), encoded once and shared by every dropped visit, so dropout works with cached text
embeddings. Shuffled tags make a different text almost every visit, which no cache keyed by the
caption can serve: that combination is refused before the run starts (kohya refuses it too),
see runner/checks.py:check_cache_compatible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.data.images import _mix
from runner.errors import UserError

TAG_SEPARATOR = ","
TAG_JOINER = ", "
# Salts of the per-visit draws; far from runner.data.images' small per-index salts.
_SALT_DROP = 0x43415044  # "CAPD"
_SALT_SHUFFLE = 0x43415053  # "CAPS"
_TWO_53 = float(1 << 53)


def uniform(seed: int, salt: int) -> float:
    """A float in [0, 1) from (seed, salt): the top 53 bits of splitmix64."""
    return (_mix(int(seed), salt) >> 11) / _TWO_53


def split_tags(caption: str) -> list[str]:
    """``"a, b ,c,"`` -> ``["a", "b", "c"]``: split on commas, strip, drop empty tags."""
    return [t for t in (part.strip() for part in caption.split(TAG_SEPARATOR)) if t]


@dataclass(frozen=True)
class CaptionRules:
    """``data.caption_dropout``, ``data.shuffle_tags``, ``data.keep_tokens`` as one value object."""

    dropout: float = 0.0
    shuffle_tags: bool = False
    keep_tokens: int = 0

    @property
    def active(self) -> bool:
        """Whether a visit's caption can differ from the file's."""
        return self.dropout > 0 or self.shuffle_tags

    def apply(self, caption: str, seed: int) -> str:
        """The caption a visit with ``seed`` trains on."""
        if self.dropout > 0 and uniform(seed, _SALT_DROP) < self.dropout:
            return ""
        if not self.shuffle_tags:
            return caption
        tags = split_tags(caption)
        keep = min(self.keep_tokens, len(tags))
        flexible = tags[keep:]
        for i in range(len(flexible) - 1, 0, -1):  # Fisher-Yates, one hash per position
            j = _mix(int(seed), _SALT_SHUFFLE + i) % (i + 1)
            flexible[i], flexible[j] = flexible[j], flexible[i]
        return TAG_JOINER.join(tags[:keep] + flexible)

    def extra_captions(self) -> set[str] | None:
        """Caption texts a visit may train on besides the files' own: ``{""}`` with dropout, none
        without; None when they cannot be listed (shuffled tags)."""
        if self.shuffle_tags:
            return None
        return {""} if self.dropout > 0 else set()

    def describe(self) -> str:
        parts = []
        if self.dropout > 0:
            parts.append(f"caption dropout {self.dropout:g}")
        if self.shuffle_tags:
            parts.append(f"tags shuffled per visit (first {self.keep_tokens} kept)" if self.keep_tokens
                         else "tags shuffled per visit")
        return ", ".join(parts)


def caption_rules(data_cfg: Any) -> CaptionRules:
    """The validated rules of ``cfg.data`` (a DataConfig, a DictConfig or a dict)."""
    from runner.data.checks import _get

    dropout = _get(data_cfg, "caption_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= float(dropout) <= 1.0:
        raise UserError(
            f"data.caption_dropout={dropout!r} is not valid: it is the probability that a visit trains with the "
            "empty caption, a number from 0 to 1 (kohya's --caption_dropout_rate), e.g. data.caption_dropout=0.1."
        )
    keep = _get(data_cfg, "keep_tokens", 0)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise UserError(
            f"data.keep_tokens={keep!r} is not valid: it is how many leading comma-separated tags stay in place "
            "when data.shuffle_tags=true, a whole number >= 0 (kohya's --keep_tokens), e.g. data.keep_tokens=1."
        )
    shuffle = _get(data_cfg, "shuffle_tags", False)
    if not isinstance(shuffle, bool):
        raise UserError(f"data.shuffle_tags={shuffle!r} is not valid: give true or false.")
    return CaptionRules(float(dropout), shuffle, int(keep))
