"""What every video family's trainer does with its clips: the data set of clips and the cache key of their frames."""
from __future__ import annotations

from typing import Any


class ClipData:
    """Mixin for a trainer with ``video_defaults(cfg)`` (frames, fps, ...) and ``self.clips`` (the clip settings)."""

    def dataset(self) -> Any:
        from runner.data import build_video_dataset
        from runner.data.video import check_frame_counts

        ds = build_video_dataset(self.cfg.data, *self.video_defaults(self.cfg))
        check_frame_counts(ds, int(self.cfg.train.batch_size))
        return ds

    def cache_signature(self, part: str) -> dict[str, Any]:
        sig = super().cache_signature(part)
        if "data" in sig:
            sig["data"]["clips"] = self.clips.signature()
        return sig
