"""finetune's settings object: every flag is a field, the parser is made from the fields, and the run's record of
them (run_flags.json) round-trips, upgrades from the flat version 1, and refuses a version it does not know."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from llama_scratch.cli import flag_of, settings_fields
from llama_scratch.finetune_settings import (
    FLAGS_VERSION,
    FinetuneSettings,
    build_parser,
    parse_args,
    recorded_flags,
    resumed_flags,
    upgrade_flags,
)


def test_every_flag_is_a_field_and_every_field_a_flag():
    parser = build_parser()
    flags = {s for a in parser._actions if a.dest != "help" for s in a.option_strings}
    fields = settings_fields(FinetuneSettings())
    assert flags == {flag for _, f, _ in fields for flag in (flag_of(f), *f.metadata["aliases"])}
    # Each flag lands in its field, under its group: nothing is copied by hand between the parser and the object.
    assert {a.dest for a in parser._actions if a.dest != "help"} == {f"{g}.{f.name}" for g, f, _ in fields}
    names = [f.name for _, f, _ in fields]
    assert len(names) == len(set(names)), "a field's name is unique across groups (version 1 records are flat)"


def test_parsing_fills_the_groups_and_notes_what_was_typed():
    s = parse_args(["--data", "x.csv", "--lora", "8", "--trainable", "4", "--no-header", "--output", "o"])
    assert (s.data.source, s.lora.rank, s.recipe.train_last, s.data.header) == ("x.csv", 8, "4", False)
    assert s.output.output == Path("o") and s.recipe.epochs is None and s.model.device == "auto"
    assert s.typed == {"data.source", "lora.rank", "recipe.train_last", "data.header", "output.output"}
    assert parse_args([]) == FinetuneSettings()  # no flags: every default
    with pytest.raises(SystemExit):
        parse_args(["--batch-tokens", "0"])  # a count of tokens is positive, refused while parsing


def test_the_record_round_trips_and_a_typed_flag_must_agree(tmp_path):
    started = parse_args(["--data", "x.csv", "--lora", "8", "--epochs", "3", "--tensorboard", "tb", "--output", "o"])
    record = json.loads(json.dumps(recorded_flags(started)))  # as run_flags.json keeps it
    assert record["version"] == FLAGS_VERSION and "output" not in record["settings"]["output"]
    resumed = resumed_flags(parse_args(["--resume", "--output", "o"]), record, tmp_path)
    for group in ("data", "model", "recipe", "lora", "compute", "parallel"):
        assert getattr(resumed, group) == getattr(started, group), group
    assert resumed.output.tensorboard == Path("tb") and resumed.output.resume  # a path again; this call's --resume
    # What the run trains on may not change; how it computes may (`on_resume`).
    changed = resumed_flags(parse_args(["--resume", "--device", "cpu", "--save-every", "7"]), record, tmp_path)
    assert (changed.model.device, changed.output.save_every) == ("cpu", 7)
    with pytest.raises(ValueError, match=r"\(--lora was 8, now 4\); leave them out"):
        resumed_flags(parse_args(["--resume", "--lora", "4"]), record, tmp_path)


def test_a_version_1_record_is_upgraded_and_a_newer_one_refused(tmp_path):
    old = {"data": "x.csv", "lora": 8, "lora_targets": "q,v", "epochs": 3, "plan": False, "gone_flag": 1}
    nested = upgrade_flags(old, tmp_path)
    assert nested["data"] == {"source": "x.csv"} and nested["lora"] == {"rank": 8, "targets": "q,v"}
    assert nested["recipe"] == {"epochs": 3, "pooling": "last"}  # a run before --pooling read the last token
    assert nested["plan"] == {"requested": False}
    resumed = resumed_flags(parse_args(["--resume"]), old, tmp_path)
    assert (resumed.data.source, resumed.lora.rank, resumed.recipe.epochs) == ("x.csv", 8, 3)
    with pytest.raises(ValueError, match=r"newer llama_scratch \(version 3; this one reads up to 2\)"):
        upgrade_flags({"version": 3, "settings": {}}, tmp_path / "run_flags.json")
    with pytest.raises(ValueError, match="does not hold a run's settings"):
        upgrade_flags({"version": 2}, tmp_path)
    with pytest.raises(ValueError, match="does not hold a run's settings"):  # a group that is not one
        upgrade_flags({"version": 2, "settings": {"recipe": None}}, tmp_path)


def test_a_record_from_before_pooling_read_the_last_token(tmp_path):
    """run_flags.json written before --pooling existed: that run read the last token, so --pooling mean typed on its
    --resume is a change, refused like any other, and a bare --resume keeps the last token."""
    record = json.loads(json.dumps(recorded_flags(parse_args(["--data", "x.csv"]))))
    del record["settings"]["recipe"]["pooling"]
    assert resumed_flags(parse_args(["--resume"]), record, tmp_path).recipe.pooling == "last"
    with pytest.raises(ValueError, match=r"\(--pooling was 'last', now 'mean'\)"):
        resumed_flags(parse_args(["--resume", "--pooling", "mean"]), record, tmp_path)


def test_the_recipe_defaults_are_the_loop_s():
    from llama_scratch.training.loop import TrainSettings

    recipe, loop = FinetuneSettings().recipe, TrainSettings()
    for f in dataclasses.fields(recipe):
        if hasattr(loop, f.name) and getattr(recipe, f.name) is not None and f.name != "class_weights":
            assert getattr(recipe, f.name) == getattr(loop, f.name), f.name
