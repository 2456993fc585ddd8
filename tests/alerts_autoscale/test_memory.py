"""The demand history on disk: a restarted autoscaler keeps its predictive term."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from alerts.autoscale.hooks import ScalingGauges
from alerts.autoscale.memory import FORMAT, MAX_DESIRED, HistoryFile, decode, decode_states, encode
from alerts.autoscale.policy import (
    DemandHistory,
    ModelState,
    Observation,
    PolicyParams,
    model_limits,
    params_from_config,
)
from alerts.autoscale.service import Autoscaler
from infermeter.config import Config

DAY = 86400.0


class Script:
    """A reader that answers the observations a test sets, one model at a time."""

    def __init__(self) -> None:
        self.next: dict[str, Observation] = {}

    async def read(self) -> dict[str, Observation] | None:
        return dict(self.next)


def scaler(config: Config, path: Path, reader: Script, save_seconds: float = 0.0) -> Autoscaler:
    params = params_from_config(config)
    limits = {m.name: model_limits(config, m.name) for m in config.models}
    memory = HistoryFile(path, params, [m.name for m in config.models], save_seconds=save_seconds)
    return Autoscaler(params, limits, reader, ScalingGauges(), memory=memory)


async def feed_a_busy_morning(autoscaler: Autoscaler, reader: Script) -> None:
    """Yesterday between 09:50 and 10:30, chat-small ran 8 replicas at 90%."""
    for minute in range(590, 630, 5):
        reader.next = {"chat-small": Observation(minute * 60.0, 8, 0.0, None, 0.9)}
        await autoscaler.tick()


async def test_restart_keeps_the_predictive_term(config: Config, tmp_path: Path) -> None:
    """A new autoscaler on the same file decides the next morning exactly as the old one would."""
    path = tmp_path / "history.json"
    reader = Script()
    first = scaler(config, path, reader)
    await feed_a_busy_morning(first, reader)
    first.save_history()  # what serve_autoscaler does on the way out

    restarted = scaler(config, path, Script())
    forgetful = scaler(config, tmp_path / "elsewhere.json", Script())
    morning = {"chat-small": Observation(DAY + 9 * 3600 + 55 * 60, 2, 0.0, None, 0.2)}
    decisions = []
    for autoscaler in (first, restarted, forgetful):
        assert isinstance(autoscaler.reader, Script)
        autoscaler.reader.next = morning
        decisions.append((await autoscaler.tick())["chat-small"])
    before, after, none = decisions
    assert before.desired == 11  # ceil(8 x 0.9 / 0.7 target utilization)
    assert (after.desired, after.reasons) == (before.desired, before.reasons)
    assert none.desired == 2


async def test_a_restarted_autoscaler_steps_from_the_count_it_last_asked_for(
    config: Config, tmp_path: Path
) -> None:
    """A scale-up from 4 to 5 is saved at the tick it is decided (the process then dies, with
    no save on the way out): the restarted autoscaler holds 5 while the fifth replica starts,
    where one without the file steps from the 4 it sees and asks the fifth away."""
    path = tmp_path / "history.json"
    reader = Script()
    first = scaler(config, path, reader, save_seconds=3600.0)
    desired = []
    for t in (0.0, 15.0, 30.0, 45.0):  # 15 waiting: 5 beyond the threshold, one replica's worth
        reader.next = {"chat-small": Observation(t, 4, 15.0)}
        desired.append((await first.tick())["chat-small"].desired)
    assert desired[-1] == 5
    calm = {"chat-small": Observation(60.0, 4, 0.0)}
    restarted, forgetful = scaler(config, path, Script()), scaler(config, tmp_path / "x", Script())
    decisions = []
    for autoscaler in (restarted, forgetful):
        assert isinstance(autoscaler.reader, Script)
        autoscaler.reader.next = calm
        decisions.append((await autoscaler.tick())["chat-small"])
    after, none = decisions
    assert after.desired == 5
    assert after.reasons == (
        "holding 5: 4 seen serving (a replica whose page was not read "
        "this tick is not taken as gone)",
    )
    assert none.desired == 4


async def test_a_restart_after_a_scale_up_keeps_its_cool_down(
    config: Config, tmp_path: Path
) -> None:
    """Scaled up from 4 to 5 at 30 s, with the queue still high while the fifth replica starts:
    the process that kept running holds 5 through the cool-down (180 s), and so does one
    restarted from the file after 45 s, tick for tick; one that knows the count but not when it
    changed adds a sixth replica 90 s before the cool-down's end."""
    path = tmp_path / "history.json"
    reader = Script()
    first = scaler(config, path, reader, save_seconds=3600.0)
    for t in (0.0, 15.0, 30.0, 45.0):  # 15 waiting: 5 beyond the threshold, one replica's worth
        reader.next = {"chat-small": Observation(t, 4, 15.0)}
        decision = (await first.tick())["chat-small"]
    assert decision.desired == 5
    restarted, forgetful = scaler(config, path, Script()), scaler(config, tmp_path / "x", Script())
    forgetful.states["chat-small"] = ModelState(last_desired=5)  # (only the change is missing)
    runs: list[list[int]] = [[], [], []]
    for t in range(60, 300, 15):
        busy = {"chat-small": Observation(float(t), 4 if t < 120 else 5, 15.0)}
        for run, autoscaler in zip(runs, (first, restarted, forgetful), strict=True):
            autoscaler.reader = Script()
            autoscaler.reader.next = busy
            run.append((await autoscaler.tick())["chat-small"].desired)
    kept, after, none = runs
    assert kept == [5] * 10 + [6] * 6  # decided at 30 s: the cool-down ends at 210 s
    assert after == kept
    assert none == [5] * 4 + [6] * 12  # a sixth replica at 120 s, 90 s before the cool-down's end


def test_a_file_without_desired_counts_steps_from_the_replicas_seen(config: Config) -> None:
    """A file written before the counts were kept is still read: histories, and no count."""
    params = params_from_config(config)
    rows = ((3, (0.5,) + (None,) * 95),)
    raw = b'{"format": "%s", "slot_seconds": 900, "day_seconds": 86400.0, "models": %s}' % (
        FORMAT.encode(),
        b'{"chat-small": [[3, [0.5' + b", null" * 95 + b"]]]}",
    )
    assert decode_states(raw, params, ["chat-small"]) == {
        "chat-small": ModelState(history=DemandHistory(rows))
    }


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"format": "infermeter.autoscale.history/1", "slot', "not JSON"),
        (b'{"alerts": []}', "not an autoscaler history"),
        (
            b'{"format": "%s", "slot_seconds": 60, "day_seconds": 86400.0, "models": {}}'
            % FORMAT.encode(),
            "recorded with slot_seconds=60",
        ),
        (
            b'{"format": "%s", "slot_seconds": 900, "day_seconds": 86400.0, '
            b'"models": {"chat-small": [[3, [1.0]]]}}' % FORMAT.encode(),
            "does not have 96 slots",
        ),
        (b"\x00\xff" * 40, "not JSON"),
        *(
            (
                b'{"format": "%s", "slot_seconds": 900, "day_seconds": 86400.0, "models": {}, '
                b'"desired": {"chat-small": %s}}' % (FORMAT.encode(), count),
                f"desired.chat-small is {shown}, not a replica count within 0..{MAX_DESIRED}",
            )
            for count, shown in [
                (b"-1", "-1"),
                (b"1000000000", "1000000000"),
                (b"true", "True"),
                (b"3.0", "3.0"),
                (b'"3"', "'3'"),
            ]
        ),
        (
            b'{"format": "%s", "slot_seconds": 900, "day_seconds": 86400.0, "models": {}, '
            b'"desired": [3]}' % FORMAT.encode(),
            "'desired' is not a mapping",
        ),
        (
            b'{"format": "%s", "slot_seconds": 900, "day_seconds": 86400.0, "models": {}, '
            b'"desired": {}, "changes": [3]}' % FORMAT.encode(),
            "'changes' is not a mapping",
        ),
        *(
            (
                b'{"format": "%s", "slot_seconds": 900, "day_seconds": 86400.0, "models": {}, '
                b'"desired": {"chat-small": 3}, "changes": {"chat-small": %s}}'
                % (FORMAT.encode(), change),
                f"changes.chat-small is {shown}, not [time, 1 or -1]",
            )
            for change, shown in [
                (b"[30.0, 0]", "[30.0, 0]"),
                (b"[30.0, 2]", "[30.0, 2]"),
                (b"[-1.0, 1]", "[-1.0, 1]"),
                (b'["30", 1]', "['30', 1]"),
                (b"[30.0, true]", "[30.0, True]"),
                (b"[30.0]", "[30.0]"),
                (b"30.0", "30.0"),
            ]
        ),
        (
            b'{"format": "%s", "slot_seconds": 900, "day_seconds": 86400.0, "models": {}, '
            b'"desired": {"chat-small": 3}, "changes": {"chat-small": [1e12, 1]}}'
            % FORMAT.encode(),
            "changes.chat-small is at 1000000000000.0",
        ),
    ],
)
def test_unusable_file_warns_and_starts_empty(
    config: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    """A torn, foreign or mismatched file, or one holding a count no autoscaler asked for, is one
    warning naming the reason, an empty history and no count: the first tick steps from the
    replicas seen."""
    path = tmp_path / "history.json"
    path.write_bytes(content)
    memory = HistoryFile(path, params_from_config(config), ["chat-small"])
    with caplog.at_level(logging.WARNING, logger="infermeter.autoscale"):
        assert memory.load() == {}
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert reason in caplog.records[0].getMessage()
    assert str(path) in caplog.records[0].getMessage()


def test_round_trip_keeps_only_configured_models_and_the_newest_days() -> None:
    """Decoding drops unknown models and keeps history_days + 1 rows, as recording does."""
    params = PolicyParams(slot_seconds=43200, history_days=2)
    rows = tuple((day, (float(day), None)) for day in range(5))
    raw = encode({"chat-small": DemandHistory(rows), "retired": DemandHistory(rows)}, params)
    assert decode(raw, params, ["chat-small", "chat-large"]) == {
        "chat-small": DemandHistory(rows[-3:])
    }


async def test_saves_are_whole_files_at_most_every_interval(config: Config, tmp_path: Path) -> None:
    """Ticks within the save interval write nothing; the file is never left as a temporary."""
    path = tmp_path / "state" / "history.json"
    now = [0.0]
    params = params_from_config(config)
    memory = HistoryFile(path, params, ["chat-small"], save_seconds=5.0, clock=lambda: now[0])
    history = DemandHistory(((0, (0.5,) + (None,) * 95),))
    await memory.maybe_save({"chat-small": ModelState(history=history)})
    saved = path.read_bytes()
    later = DemandHistory(((0, (0.9,) + (None,) * 95),))
    now[0] = 4.0
    await memory.maybe_save({"chat-small": ModelState(history=later)})
    assert path.read_bytes() == saved
    now[0] = 5.0
    await memory.maybe_save({"chat-small": ModelState(history=later)})
    assert decode(path.read_bytes(), params, ["chat-small"]) == {"chat-small": later}
    assert sorted(p.name for p in path.parent.iterdir()) == ["history.json"]


def test_a_failing_save_is_reported_once_and_its_recovery_once(
    config: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Saves into a path that cannot be written log one error, not one per save, then one recovery."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    memory = HistoryFile(blocker / "history.json", params_from_config(config), ["chat-small"])
    states = [
        {"chat-small": ModelState(history=DemandHistory(((0, (v,) + (None,) * 95),)))}
        for v in (0.1, 0.2, 0.3)
    ]
    with caplog.at_level(logging.INFO, logger="infermeter.autoscale"):
        memory.save(states[0])
        memory.save(states[1])
        blocker.unlink()
        memory.save(states[2])
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING]
    assert "cannot save the demand history" in caplog.records[0].getMessage()
    assert decode((blocker / "history.json").read_bytes(), memory.params, ["chat-small"])
