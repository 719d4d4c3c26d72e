"""Tests for runtime.time: Time strings and Progress counters."""

from __future__ import annotations

import json

import pytest

from runtime.time import (
    Progress,
    Time,
    TimeError,
    TimeUnit,
    as_fraction,
    check_fraction,
    scaled,
)

# ---------------------------------------------------------------- Time.parse


@pytest.mark.parametrize(
    ("text", "value", "unit"),
    [
        ("10ep", 10, TimeUnit.EPOCH),
        ("2000ba", 2000, TimeUnit.BATCH),
        ("4096sp", 4096, TimeUnit.SAMPLE),
        ("1e6tok", 1_000_000, TimeUnit.TOKEN),
        ("1_000ba", 1000, TimeUnit.BATCH),
        ("  7ep \n", 7, TimeUnit.EPOCH),
        ("0.25dur", 0.25, TimeUnit.DURATION),
        ("1dur", 1.0, TimeUnit.DURATION),
        ("1e-3dur", 0.001, TimeUnit.DURATION),
        ("123456789012345678901tok", 123456789012345678901, TimeUnit.TOKEN),
    ],
)
def test_parse_valid(text: str, value: int | float, unit: TimeUnit) -> None:
    parsed = Time.parse(text)
    assert parsed == Time(value, unit)
    assert parsed.unit is unit
    assert type(parsed.value) is (float if unit is TimeUnit.DURATION else int)


def test_parse_counts_are_int_even_from_exponent_form() -> None:
    assert Time.parse("1e6tok").value == 1_000_000
    assert isinstance(Time.parse("1e6tok").value, int)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("10", "missing unit"),
        ("1e6", "missing unit"),
        ("ba", "missing number"),
        ("20bb", "unknown unit 'bb'"),
        ("1.5ba", "whole numbers"),
        ("-5ba", "greater than 0"),
        ("0ep", "greater than 0"),
        ("0dur", "greater than 0"),
        ("1.5dur", "at most 1"),
        ("nan ba", "not a number"),
        ("1e999tok", "not finite"),
        ("true", "unknown unit"),
        ("1__0ba", "not a number"),
        ("1.2.3ep", "not a number"),
    ],
)
def test_parse_invalid_names_text_and_reason(text: str, reason: str) -> None:
    with pytest.raises(TimeError) as caught:
        Time.parse(text)
    message = str(caught.value)
    assert repr(text) in message
    assert reason in message
    assert "ep, ba, sp, tok, dur" in message


def test_parse_error_message_matches_documented_form() -> None:
    with pytest.raises(TimeError) as caught:
        Time.parse("20bb")
    assert str(caught.value) == (
        "bad Time string '20bb': unknown unit 'bb'; write a number followed by "
        "one of ep, ba, sp, tok, dur (e.g. 2000ba, 0.25dur)"
    )


@pytest.mark.parametrize("junk", [True, 10, 0.5, None])
def test_parse_rejects_non_strings(junk: object) -> None:
    with pytest.raises(TimeError):
        Time.parse(junk)  # type: ignore[arg-type]


def test_parse_returns_time_instances_unchanged() -> None:
    time = Time(5, TimeUnit.EPOCH)
    assert Time.parse(time) is time


def test_time_is_a_value_error_for_callers_that_catch_value_error() -> None:
    with pytest.raises(ValueError):
        Time.parse("5xx")


@pytest.mark.parametrize(
    ("value", "unit"),
    [
        (1.5, TimeUnit.BATCH),
        (0, TimeUnit.EPOCH),
        (True, TimeUnit.BATCH),
        (2.0, TimeUnit.DURATION),
        (3, "weeks"),
    ],
)
def test_constructor_validates(value: object, unit: object) -> None:
    with pytest.raises(TimeError):
        Time(value, unit)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("2000ba", "2000ba"),
        ("1e6tok", "1000000tok"),
        ("0.25dur", "0.25dur"),
        ("1_0ep", "10ep"),
        ("1dur", "1.0dur"),
    ],
)
def test_str_is_canonical_and_round_trips(text: str, canonical: str) -> None:
    time = Time.parse(text)
    assert str(time) == canonical
    assert Time.parse(str(time)) == time


# ---------------------------------------------------------------- Progress


def run_steps(
    progress: Progress, steps: int, samples: int = 4, tokens: int = 100
) -> None:
    for _ in range(steps):
        progress.advance(samples=samples, tokens=tokens)


def test_advance_counts_and_rolls_over_epochs() -> None:
    progress = Progress(batches_per_epoch=3)
    run_steps(progress, 2)
    assert (progress.epoch, progress.batch, progress.batch_in_epoch) == (0, 2, 2)
    run_steps(progress, 1)
    assert (progress.epoch, progress.batch, progress.batch_in_epoch) == (1, 3, 0)
    run_steps(progress, 4)
    assert (progress.epoch, progress.batch, progress.batch_in_epoch) == (2, 7, 1)
    assert progress.sample == 28
    assert progress.token == 700


def test_count_per_unit_and_dur_is_rejected() -> None:
    progress = Progress(batches_per_epoch=2)
    run_steps(progress, 5, samples=8, tokens=50)
    assert progress.count(TimeUnit.EPOCH) == 2
    assert progress.count(TimeUnit.BATCH) == 5
    assert progress.count(TimeUnit.SAMPLE) == 40
    assert progress.count(TimeUnit.TOKEN) == 250
    with pytest.raises(TimeError):
        progress.count(TimeUnit.DURATION)


@pytest.mark.parametrize("bad", [0, -1])
def test_progress_rejects_non_positive_batches_per_epoch(bad: int) -> None:
    with pytest.raises(ValueError, match="batches_per_epoch"):
        Progress(batches_per_epoch=bad)


@pytest.mark.parametrize(
    ("max_duration", "steps_to_finish"),
    [("2ep", 8), ("5ba", 5), ("20sp", 5), ("1000tok", 10)],
)
def test_reached_for_each_unit(max_duration: str, steps_to_finish: int) -> None:
    # 4 batches per epoch, 4 samples and 100 tokens per step
    progress = Progress(batches_per_epoch=4)
    limit = Time.parse(max_duration)
    steps = 0
    while not progress.reached(limit):
        progress.advance(samples=4, tokens=100)
        steps += 1
    assert steps == steps_to_finish


def test_reached_rejects_dur_max_duration() -> None:
    with pytest.raises(TimeError, match="max_duration cannot be a fraction of itself"):
        Progress(batches_per_epoch=1).reached(Time.parse("0.5dur"))


def test_fraction_in_batches_and_tokens() -> None:
    progress = Progress(batches_per_epoch=10)
    run_steps(progress, 25, tokens=10)
    assert progress.fraction(Time.parse("100ba")) == pytest.approx(0.25)
    assert progress.fraction(Time.parse("1000tok")) == pytest.approx(0.25)
    assert progress.fraction(Time.parse("10ba")) == 1.0  # clamped past the end


def test_fraction_in_epochs_counts_partial_epochs() -> None:
    progress = Progress(batches_per_epoch=4)
    run_steps(progress, 6)  # one epoch and half of the next
    assert progress.fraction(Time.parse("3ep")) == pytest.approx(1.5 / 3)
    with pytest.raises(TimeError):
        progress.fraction(Time.parse("1dur"))


def test_resolve_dur_to_max_duration_unit() -> None:
    progress = Progress(batches_per_epoch=4)
    assert progress.resolve(Time.parse("0.1dur"), Time.parse("1000ba")) == Time(
        100, TimeUnit.BATCH
    )
    assert progress.resolve(Time.parse("0.5dur"), Time.parse("10ep")) == Time(
        5, TimeUnit.EPOCH
    )
    # never resolves to 0, which could not be a period
    assert progress.resolve(Time.parse("0.001dur"), Time.parse("10ba")) == Time(
        1, TimeUnit.BATCH
    )
    absolute = Time.parse("7sp")
    assert progress.resolve(absolute, Time.parse("10ba")) is absolute


def due_steps(
    interval: str, max_duration: str, batches_per_epoch: int, tokens: int = 100
) -> list[int]:
    """The batch numbers at which `interval` fires over a whole simulated run."""
    progress = Progress(batches_per_epoch=batches_per_epoch)
    limit = Time.parse(max_duration)
    fired = []
    while not progress.reached(limit):
        progress.advance(samples=4, tokens=tokens)
        if progress.at_interval(Time.parse(interval), limit):
            fired.append(progress.batch)
    return fired


def test_at_interval_batches() -> None:
    assert due_steps("100ba", "1000ba", batches_per_epoch=30) == list(
        range(100, 1001, 100)
    )


def test_at_interval_epochs_fires_on_the_step_that_finishes_the_epoch() -> None:
    assert due_steps("1ep", "3ep", batches_per_epoch=7) == [7, 14, 21]
    assert due_steps("2ep", "6ep", batches_per_epoch=5) == [10, 20, 30]


def test_at_interval_tokens_fires_when_the_step_crosses_a_multiple() -> None:
    # 300 tokens per step: totals 300, 600, 900, 1200 (crosses 1000), ... 2100 (crosses 2000)
    assert due_steps("1000tok", "3000tok", batches_per_epoch=100, tokens=300) == [
        4,
        7,
        10,
    ]


def test_at_interval_dur_uses_max_duration_unit() -> None:
    assert due_steps("0.25dur", "100ba", batches_per_epoch=9) == [25, 50, 75, 100]
    assert due_steps("0.5dur", "4ep", batches_per_epoch=3) == [6, 12]


def test_at_interval_is_false_before_any_step() -> None:
    assert not Progress(batches_per_epoch=1).at_interval(
        Time.parse("1ba"), Time.parse("10ba")
    )


def test_state_dict_is_json_and_round_trips_at_interval_behaviour() -> None:
    interval, limit = Time.parse("10ba"), Time.parse("100ba")
    original = Progress(batches_per_epoch=6)
    run_steps(original, 20)  # the 20th step is due
    state = json.loads(json.dumps(original.state_dict()))
    assert all(type(value) is int for value in state.values())

    resumed = Progress(batches_per_epoch=6)
    resumed.load_state_dict(state)
    assert resumed == original
    assert resumed.at_interval(interval, limit)

    fired_original, fired_resumed = [], []
    for progress, fired in ((original, fired_original), (resumed, fired_resumed)):
        for _ in range(15):
            progress.advance(samples=4, tokens=100)
            fired.append(progress.at_interval(interval, limit))
    assert fired_original == fired_resumed
    assert fired_resumed.count(True) == 1  # at batch 30


def test_load_state_dict_names_missing_and_unknown_keys() -> None:
    state = Progress(batches_per_epoch=2).state_dict()
    del state["token"]
    state["tokens_seen"] = 3
    with pytest.raises(ValueError) as caught:
        Progress(batches_per_epoch=2).load_state_dict(state)
    assert "'token'" in str(caught.value)
    assert "'tokens_seen'" in str(caught.value)


def test_load_state_dict_rejects_changed_batches_per_epoch_and_bad_values() -> None:
    state = Progress(batches_per_epoch=2).state_dict()
    with pytest.raises(ValueError, match="batches_per_epoch=2"):
        Progress(batches_per_epoch=3).load_state_dict(state)
    with pytest.raises(ValueError, match="batch must be an int"):
        Progress(batches_per_epoch=2).load_state_dict({**state, "batch": 1.5})


# ---------------------------------------------------------------- as_fraction


def test_as_fraction_converts_epochs_and_batches_once_batches_per_epoch_are_known() -> (
    None
):
    """Composer's Time converts epochs and batches: a warm-up of 8ep in a 12ba trial run
    at 4 batches per epoch is 32 / 12 of the run (it does not end within it); 6ba of
    3ep at 4 per epoch is half of it."""
    eight, twelve = Time.parse("8ep"), Time.parse("12ba")
    check_fraction(eight, twelve)  # accepted before the data are read
    with pytest.raises(TimeError, match="batches per epoch"):
        as_fraction(eight, twelve)
    assert as_fraction(eight, twelve, batches_per_epoch=4) == 32 / 12
    assert as_fraction(Time.parse("2ep"), twelve, batches_per_epoch=4) == 8 / 12
    assert as_fraction(Time.parse("6ba"), Time.parse("3ep"), 4) == 0.5
    assert as_fraction(Time.parse("0.3dur"), twelve, 4) == 0.3
    assert as_fraction(Time.parse("3ba"), twelve) == 0.25


@pytest.mark.parametrize(
    ("duration", "max_duration"), [("8ep", "100sp"), ("5tok", "3ba")]
)
def test_check_fraction_refuses_samples_and_tokens_against_other_units(
    duration: str, max_duration: str
) -> None:
    with pytest.raises(TimeError, match="cannot be compared"):
        check_fraction(Time.parse(duration), Time.parse(max_duration))


def test_scaled_rounds_counts_down_keeps_fractions_and_refuses_zero() -> None:
    """Composer's scale_schedule_ratio on max_duration: Time(int(value x ratio))."""
    assert scaled(Time.parse("600ba"), 0.25) == Time(150, TimeUnit.BATCH)
    assert scaled(Time.parse("10ep"), 0.25) == Time(2, TimeUnit.EPOCH)  # 2.5 -> 2
    assert scaled(Time.parse("1000tok"), 2.0) == Time(2000, TimeUnit.TOKEN)
    assert scaled(Time.parse("0.5dur"), 0.25) == Time.parse("0.5dur")
    with pytest.raises(TimeError, match="16ba x 0.05 is less than one ba"):
        scaled(Time.parse("16ba"), 0.05)
    for ratio in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(TimeError, match="ratio must be a number > 0"):
            scaled(Time.parse("16ba"), ratio)


def test_progress_told_its_duration_once_answers_as_when_told_each_time() -> None:
    """Told max_duration at construction, every query measures against it, as the
    explicit argument does (0.3.0 projects pass it per call); checkpoints leave it
    out, so a resumed run with another max_duration uses its own."""
    limit = Time.parse("4ep")
    told = Progress(batches_per_epoch=6, max_duration=limit)
    plain = Progress(batches_per_epoch=6)
    for _ in range(9):
        for progress in (told, plain):
            progress.advance(samples=4, tokens=100)
        assert told.fraction() == plain.fraction(limit)
        assert told.reached() == plain.reached(limit)
        assert told.at_interval(Time.parse("0.25dur")) == plain.at_interval(
            Time.parse("0.25dur"), limit
        )
        assert told.resolve(Time.parse("0.5dur")) == Time(2, TimeUnit.EPOCH)
    assert "max_duration" not in told.state_dict()
    longer = Progress(batches_per_epoch=6, max_duration=Time.parse("8ep"))
    longer.load_state_dict(json.loads(json.dumps(told.state_dict())))
    assert longer.fraction() == told.fraction() / 2
    assert told.fraction(Time.parse("8ep")) == longer.fraction()  # explicit wins
    with pytest.raises(TimeError, match="pass it to Progress"):
        plain.fraction()
