"""Caption options: data.caption_dropout, data.shuffle_tags + data.keep_tokens, data.caption_ext.

Per-visit draws come from the visit's seed only, so the same seed gives the same caption in any
process and any micro-batch split; the frequencies are checked against the configured rates.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from runner.cli.compose import compose_config
from runner.config import DataConfig
from runner.checks import check_cache_compatible
from runner.data import TrainingData, build_dataset, visit_samples
from runner.data.captions import (
    CaptionRules,
    caption_rules,
    split_tags,
)
from runner.errors import UserError

CAPTION = "sks person, red hat, smiling, outdoors, , blue sky,"
TAGS = ["sks person", "red hat", "smiling", "outdoors", "blue sky"]


def test_shuffle_keeps_the_first_tags_and_every_tag_once():
    rules = CaptionRules(shuffle_tags=True, keep_tokens=1)
    seen = set()
    for seed in range(200):
        out = rules.apply(CAPTION, seed)
        tags = out.split(", ")
        assert tags[0] == "sks person"  # kept in place
        assert sorted(tags) == sorted(TAGS)  # nothing lost or doubled; the empty tag is dropped
        seen.add(out)
        assert rules.apply(CAPTION, seed) == out  # a pure function of the seed
    # 4 flexible tags: 24 orders, and 200 seeds find (nearly) all of them
    assert len(seen) >= 20
    assert CaptionRules(shuffle_tags=True, keep_tokens=2).apply(CAPTION, 5).startswith("sks person, red hat, ")
    assert CaptionRules(shuffle_tags=True, keep_tokens=9).apply(CAPTION, 5) == ", ".join(TAGS)  # more than there are


def test_keep_tokens_alone_changes_nothing_and_split_strips():
    assert CaptionRules(keep_tokens=2).apply(CAPTION, 3) == CAPTION  # kohya: keep_tokens acts with shuffling
    assert split_tags(" a ,b,, c ,") == ["a", "b", "c"]


def test_dropout_rate_and_independence_from_the_shuffle():
    rules = CaptionRules(dropout=0.25, shuffle_tags=True)
    n = 4000
    dropped = sum(rules.apply(CAPTION, seed) == "" for seed in range(n))
    # binomial(4000, 0.25): sd 27; 5 sd
    assert abs(dropped - n * 0.25) < 5 * (n * 0.25 * 0.75) ** 0.5
    # the visits that are not dropped are shuffled as without dropout (the draws use different salts)
    plain = CaptionRules(shuffle_tags=True)
    assert all(rules.apply(CAPTION, s) in ("", plain.apply(CAPTION, s)) for s in range(300))
    assert CaptionRules(dropout=1.0).apply(CAPTION, 0) == "" and CaptionRules().apply(CAPTION, 0) == CAPTION


def test_extra_captions_for_the_cache():
    assert CaptionRules().extra_captions() == set()
    assert CaptionRules(dropout=0.1).extra_captions() == {""}
    assert CaptionRules(dropout=0.1, shuffle_tags=True).extra_captions() is None


@pytest.mark.parametrize("key, value, words", [
    ("caption_dropout", 1.5, ["data.caption_dropout=1.5", "from 0 to 1"]),
    ("caption_dropout", -0.1, ["data.caption_dropout"]),
    ("keep_tokens", -1, ["data.keep_tokens=-1"]),
])
def test_bad_values_name_the_key(key, value, words):
    with pytest.raises(UserError) as e:
        caption_rules({key: value})
    for w in words:
        assert w in str(e.value)


def test_shuffle_with_cached_text_is_refused_naming_both_keys():
    cfg = compose_config(["offload=park", "data.shuffle_tags=true"])
    with pytest.raises(UserError) as e:
        check_cache_compatible(cfg)
    assert "data.shuffle_tags" in str(e.value) and "offload.park.cache_text" in str(e.value)
    check_cache_compatible(compose_config(["offload=park", "data.shuffle_tags=true", "offload.park.cache_text=false"]))
    check_cache_compatible(compose_config(["offload=park", "data.caption_dropout=0.5"]))
    check_cache_compatible(compose_config(["data.shuffle_tags=true"]))  # no cache at all


# ---- through the data set -----------------------------------------------------------------------
def write(folder: Path, name: str, caption: str, ext: str = ".txt") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 40), (200, 30, 30)).save(folder / f"{name}.png")
    (folder / f"{name}{ext}").write_text(caption, encoding="utf-8")


def test_caption_ext_reads_other_files_and_names_the_wrong_one(tmp_path):
    write(tmp_path, "a", "from the caption file", ".caption")
    (tmp_path / "a.txt").write_text("from the txt file")
    cfg = DataConfig(resolution=32, path=str(tmp_path))
    assert build_dataset(replace(cfg, caption_ext=".caption"))[0]["caption"] == "from the caption file"
    assert build_dataset(cfg)[0]["caption"] == "from the txt file"
    (tmp_path / "a.txt").unlink()
    with pytest.raises(UserError) as e:
        build_dataset(cfg)
    assert "a.caption is there: set data.caption_ext=.caption" in str(e.value)
    for bad in ("caption", "./x", ".", "*.txt"):
        with pytest.raises(UserError) as e:
            build_dataset(replace(cfg, caption_ext=bad))
        assert "data.caption_ext" in str(e.value)


def test_visits_draw_their_caption_from_their_seed(tmp_path):
    write(tmp_path, "a", CAPTION)
    write(tmp_path, "b", "x, y, z")
    ds = build_dataset(OmegaConf.structured(DataConfig(resolution=32, path=str(tmp_path), caption_dropout=0.3,
                                                       shuffle_tags=True, keep_tokens=1)))
    assert isinstance(ds, TrainingData) and len(ds) == 2
    assert ds[0]["caption"] == CAPTION and ds.caption(0) == CAPTION  # the file's caption
    import torch

    seeds = torch.tensor([11, 12, 13, 14])
    a = visit_samples(ds, [0, 0, 1, 1], seeds)
    b = visit_samples(ds, [0, 0, 1, 1], seeds)
    assert [s["caption"] for s in a] == [s["caption"] for s in b]
    rules = caption_rules({"caption_dropout": 0.3, "shuffle_tags": True, "keep_tokens": 1})
    assert [s["caption"] for s in a] == [rules.apply(c, int(s)) for c, s in zip([CAPTION, CAPTION, "x, y, z", "x, y, z"], seeds)]
    assert "caption dropout 0.3, tags shuffled per visit (first 1 kept)" in ds.describe()
