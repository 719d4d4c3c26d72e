"""Time strings ("2000ba", "10ep", "0.25dur") and training progress counters.

A `Time` is an amount of training in one unit. `Progress` counts what a run
has done so far, in every unit at once, and answers the questions a training
loop asks: is training finished, how far along is it, is an interval due.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum


class TimeUnit(str, Enum):
    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"


class TimeError(ValueError):
    """A Time string or Time value that cannot be used."""


_UNIT_LIST = ", ".join(unit.value for unit in TimeUnit)
_FORMAT_HINT = f"write a number followed by one of {_UNIT_LIST} (e.g. 2000ba, 0.25dur)"

# Only digits, '.', '_', exponent and sign characters may reach float(); this
# keeps out "nan", "inf" and friends, which float() would otherwise accept.
_NUMBER_CHARS = re.compile(r"[0-9._eE+-]+")
_TRAILING_LETTERS = re.compile(r"[A-Za-z]*$")


def _bad(text: object, reason: str) -> TimeError:
    return TimeError(f"bad Time string {text!r}: {reason}; {_FORMAT_HINT}")


@dataclass(frozen=True)
class Time:
    """An amount of training: a whole count of ep/ba/sp/tok, or a fraction (dur) of the run."""

    value: int | float
    unit: TimeUnit

    def __post_init__(self) -> None:
        try:
            unit = TimeUnit(self.unit)
        except ValueError:
            raise TimeError(
                f"unknown Time unit {self.unit!r}; use one of {_UNIT_LIST}"
            ) from None
        # frozen dataclass: the only way to normalise a field after construction
        object.__setattr__(self, "unit", unit)
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TimeError(f"Time value must be a number, got {value!r}")
        if unit is TimeUnit.DURATION:
            if not (0 < value <= 1):
                raise TimeError(f"a dur Time must be in (0, 1], got {value!r}")
            object.__setattr__(self, "value", float(value))
        else:
            if not isinstance(value, int) or value <= 0:
                raise TimeError(
                    f"a {unit.value} Time must be a positive whole number, got {value!r}"
                )

    @classmethod
    def parse(cls, text: str | Time) -> Time:
        """Parse "10ep", "2000ba", "1e6tok", "1_000sp", "0.25dur" (a Time is returned as is)."""
        if isinstance(text, Time):
            return text
        if not isinstance(text, str):
            raise _bad(text, f"expected a string, got {type(text).__name__}")
        stripped = text.strip()
        if not stripped:
            raise _bad(text, "it is empty")
        unit_text = _TRAILING_LETTERS.search(stripped).group()  # type: ignore[union-attr]
        number_text = stripped[: len(stripped) - len(unit_text)].strip()
        if not unit_text:
            raise _bad(text, "missing unit")
        try:
            unit = TimeUnit(unit_text.lower())
        except ValueError:
            raise _bad(text, f"unknown unit {unit_text!r}") from None
        if not number_text:
            raise _bad(text, "missing number")
        if not _NUMBER_CHARS.fullmatch(number_text):
            raise _bad(text, f"{number_text!r} is not a number")
        try:
            number = float(number_text)
        except ValueError:
            raise _bad(text, f"{number_text!r} is not a number") from None
        if not math.isfinite(number):
            raise _bad(text, f"{number_text!r} is not finite")
        if number <= 0:
            raise _bad(text, "the number must be greater than 0")
        if unit is TimeUnit.DURATION:
            if number > 1:
                raise _bad(
                    text, "a dur value is a fraction of the run and must be at most 1"
                )
            return cls(number, unit)
        if not number.is_integer():
            raise _bad(text, f"{unit.value} counts must be whole numbers")
        try:
            # int() keeps large plain integers exact; float() is only for "1e6"
            whole = int(number_text)
        except ValueError:
            whole = int(number)
        return cls(whole, unit)

    def __str__(self) -> str:
        return f"{self.value!r}{self.unit.value}"


def scaled(time: Time, ratio: float) -> Time:
    """`time` x `ratio` (Composer's scale_schedule_ratio on max_duration): a count is
    rounded down to a whole one, as Composer's Time does; a fraction (dur) is left as
    it is (it follows what it is a fraction of). TimeError if it comes to 0."""
    if not (math.isfinite(ratio) and ratio > 0):
        raise TimeError(f"the ratio must be a number > 0, got {ratio!r}")
    if time.unit is TimeUnit.DURATION:
        return time
    value = int(time.value * ratio)
    if value == 0:
        raise TimeError(
            f"{time} x {ratio:g} is less than one {time.unit.value}; "
            "pick a larger ratio or a finer unit (e.g. ba)"
        )
    return Time(value, time.unit)


_COUNT_UNITS = (TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN)


@dataclass
class Progress:
    """Where training is: counters advanced once per optimizer step.

    Counts are global (summed over all ranks), so they do not depend on the
    world size. The previous_* counters hold the counts before the last
    advance(); at_interval() compares them with the current ones.

    `max_duration`, told once, is what reached(), fraction(), resolve() and
    at_interval() measure against. It is this run's, not a counter: checkpoints
    leave it out, so a resumed run with another max_duration uses the new one.
    Each query still takes an explicit max_duration (projects generated by
    scaffold 0.3.0 pass it on every call).
    """

    batches_per_epoch: int
    max_duration: Time | None = field(default=None, kw_only=True)
    epoch: int = 0
    batch: int = 0
    sample: int = 0
    token: int = 0
    batch_in_epoch: int = 0
    previous_epoch: int = 0
    previous_batch: int = 0
    previous_sample: int = 0
    previous_token: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.batches_per_epoch, bool) or not isinstance(
            self.batches_per_epoch, int
        ):
            raise ValueError(
                f"batches_per_epoch must be an int, got {self.batches_per_epoch!r}"
            )
        if self.batches_per_epoch <= 0:
            raise ValueError(
                f"batches_per_epoch must be > 0, got {self.batches_per_epoch}; "
                "is the training data loader empty?"
            )

    def count(self, unit: TimeUnit) -> int:
        """The current count in `unit` (not defined for dur)."""
        return self._count(unit, previous=False)

    def _count(self, unit: TimeUnit, previous: bool) -> int:
        unit = TimeUnit(unit)
        if unit is TimeUnit.DURATION:
            raise TimeError(
                "dur is a fraction of max_duration, not a count; use fraction() or resolve()"
            )
        name = {
            TimeUnit.EPOCH: "epoch",
            TimeUnit.BATCH: "batch",
            TimeUnit.SAMPLE: "sample",
            TimeUnit.TOKEN: "token",
        }[unit]
        return getattr(self, f"previous_{name}" if previous else name)

    def advance(self, samples: int, tokens: int) -> None:
        """Record one optimizer step that consumed `samples` samples and `tokens` tokens."""
        if samples < 0 or tokens < 0:
            raise ValueError(
                f"samples and tokens must be >= 0, got samples={samples}, tokens={tokens}"
            )
        self.previous_epoch = self.epoch
        self.previous_batch = self.batch
        self.previous_sample = self.sample
        self.previous_token = self.token
        self.batch += 1
        self.sample += samples
        self.token += tokens
        self.batch_in_epoch += 1
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0

    def _duration(self, max_duration: Time | None) -> Time:
        """The explicit max_duration, else the one told at construction."""
        duration = self.max_duration if max_duration is None else max_duration
        if duration is None:
            raise TimeError("Progress was not told max_duration: pass it to Progress()")
        _check_max_duration(duration)
        return duration

    def reached(self, max_duration: Time | None = None) -> bool:
        """True once training has done at least `max_duration`."""
        max_duration = self._duration(max_duration)
        return self.count(max_duration.unit) >= max_duration.value

    def fraction(self, max_duration: Time | None = None) -> float:
        """How much of `max_duration` is done, in [0, 1]."""
        max_duration = self._duration(max_duration)
        if max_duration.unit is TimeUnit.EPOCH:
            # count partial epochs so schedules move smoothly within an epoch
            done = self.epoch + self.batch_in_epoch / self.batches_per_epoch
        else:
            done = self.count(max_duration.unit)
        return min(1.0, done / max_duration.value)

    def resolve(self, interval: Time, max_duration: Time | None = None) -> Time:
        """Turn a dur interval into an absolute Time in max_duration's unit; others pass through."""
        if interval.unit is not TimeUnit.DURATION:
            return interval
        max_duration = self._duration(max_duration)
        # never 0: an interval of 0 would never (or always) be due
        return Time(
            max(1, round(interval.value * max_duration.value)), max_duration.unit
        )

    def at_interval(self, interval: Time, max_duration: Time | None = None) -> bool:
        """True when the last advance() crossed a multiple of `interval` (e.g. batch 100, 200 for 100ba)."""
        resolved = self.resolve(interval, max_duration)
        every = int(resolved.value)
        before = self._count(resolved.unit, previous=True)
        now = self._count(resolved.unit, previous=False)
        return before // every != now // every

    def state_dict(self) -> dict[str, int]:
        """All counters as plain ints (checkpoints store this as JSON)."""
        return {name: getattr(self, name) for name in self._counters()}

    def _counters(self) -> list[str]:
        return [each.name for each in fields(self) if each.name != "max_duration"]

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore counters saved by state_dict()."""
        expected = self._counters()
        missing = [name for name in expected if name not in state]
        unknown = [name for name in state if name not in expected]
        if missing or unknown:
            raise ValueError(
                f"bad Progress state: missing keys {missing}, unknown keys {unknown}; "
                "pass the dict saved by Progress.state_dict()"
            )
        for name in expected:
            value = state[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"bad Progress state: {name} must be an int >= 0, got {value!r}"
                )
        if state["batches_per_epoch"] != self.batches_per_epoch:
            # epoch counting would silently drift if the loader length changed
            raise ValueError(
                f"checkpoint was saved with batches_per_epoch={state['batches_per_epoch']} "
                f"but this run has {self.batches_per_epoch}; resume with the same data and batch size"
            )
        for name in expected:
            setattr(self, name, state[name])


_EPOCH_OR_BATCH = (TimeUnit.EPOCH, TimeUnit.BATCH)


def as_fraction(
    duration: Time, max_duration: Time, batches_per_epoch: int | None = None
) -> float:
    """`duration` as a fraction of `max_duration` (for schedules): `0.3dur` -> 0.3,
    `300ba` of `1000ba` -> 0.3. Epochs and batches convert once the data's
    `batches_per_epoch` is known (as Composer's Time does): `8ep` of `12ba` at 4
    batches per epoch -> 32 / 12: above 1, a warm-up still under way when the run ends
    (Composer's schedulers do the same)."""
    check_fraction(duration, max_duration)
    if duration.unit is TimeUnit.DURATION:
        return float(duration.value)
    if duration.unit is max_duration.unit:
        return duration.value / max_duration.value
    if batches_per_epoch is None:
        raise TimeError(
            f"'{duration}' and max_duration '{max_duration}' convert only once the "
            "data's batches per epoch are known; pass batches_per_epoch"
        )
    batches = [
        t.value * (batches_per_epoch if t.unit is TimeUnit.EPOCH else 1)
        for t in (duration, max_duration)
    ]
    return batches[0] / batches[1]


def check_fraction(duration: Time, max_duration: Time) -> None:
    """TimeError unless `duration` can become a fraction of `max_duration`: a dur,
    the same unit, or epochs against batches (they convert once the data are read)."""
    _check_max_duration(max_duration)
    units = {duration.unit, max_duration.unit}
    if duration.unit is TimeUnit.DURATION or len(units) == 1:
        return
    if not units <= set(_EPOCH_OR_BATCH):
        raise TimeError(
            f"'{duration}' cannot be compared with max_duration '{max_duration}'; give "
            f"it in {max_duration.unit.value} or as a fraction of training (e.g. 0.3dur)"
        )


def _check_max_duration(max_duration: Time) -> None:
    if max_duration.unit is TimeUnit.DURATION:
        raise TimeError(
            f"max_duration cannot be a fraction of itself ({max_duration}); "
            "give it in ep, ba, sp or tok (e.g. 10ep)"
        )
