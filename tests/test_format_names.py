"""One vocabulary of format names (``ckptctl.format.formats``) for ``latest --format`` (the
layouts of ``layouts.catalog``) and ``convert --to`` (the file formats of ``interop.detect``):
the same name means the same thing everywhere, every name typed before stays accepted, and a
name of the other kind is refused saying what it names."""

from __future__ import annotations

import pytest

from ckptctl.errors import UsageError
from ckptctl.format import formats
from ckptctl.interop import detect
from ckptctl.layouts import catalog


def test_the_catalog_and_detection_draw_their_names_from_the_vocabulary() -> None:
    # each built-in layout's own name, in catalog order; plugin layouts' names come after them
    assert tuple(layout.name for layout in catalog.BUILTIN) == formats.LAYOUT_NAMES
    assert catalog.FORMATS[:len(formats.LAYOUT_NAMES)] == formats.LAYOUT_NAMES
    assert detect.FORMATS == formats.FILE_FORMATS
    assert set(formats.ALIASES.values()) <= set(formats.NAMES)
    assert not set(formats.ALIASES) & set(formats.NAMES), "an alias may not shadow a name"


# Every name the two options accepted before they shared a vocabulary.
LATEST_FORMAT_BEFORE = ("ckptctl", "dcp", "hf-trainer", "megatron", "deepspeed", "lightning")
CONVERT_TO_BEFORE = ("ckptctl", "dcp", "safetensors", "torch")


@pytest.mark.parametrize("name", LATEST_FORMAT_BEFORE)
def test_every_layout_name_typed_before_still_selects_its_layout(name: str) -> None:
    assert [layout.name for layout in catalog.layouts_named([name])] == [name]


@pytest.mark.parametrize("name", CONVERT_TO_BEFORE)
def test_every_convert_target_typed_before_still_names_itself(name: str) -> None:
    assert detect.format_named(name) == name


@pytest.mark.parametrize(("alias", "layout"), [("torchtitan", "dcp"), ("HF", "hf-trainer"),
                                               ("hf_trainer", "hf-trainer"), ("Megatron-LM", "megatron")])
def test_an_alias_selects_the_layout_it_stands_for(alias: str, layout: str) -> None:
    assert [lay.name for lay in catalog.layouts_named([alias, layout])] == [layout]


def test_an_alias_names_the_convert_target_it_stands_for() -> None:
    assert detect.format_named("pt") == "torch" and detect.format_named("torchtitan") == "dcp"


def test_a_name_of_the_other_kind_is_refused_saying_what_it_names() -> None:
    with pytest.raises(ValueError, match="'safetensors' names a file format, not a layout of a root"):
        catalog.layouts_named(["safetensors"])
    with pytest.raises(UsageError, match="'hf-trainer' names a layout of a root, not a file format"):
        detect.format_named("hf-trainer")
    with pytest.raises(ValueError, match="unknown format 'nope'; known: ckptctl, dcp, hf-trainer"):
        catalog.layouts_named(["dcp", "nope"])
