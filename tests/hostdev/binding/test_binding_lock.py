"""The node's binding lock: one holder at a time across processes, the holder named to whoever
waits, the wait bounded, and the lock gone with its holder."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from binding_kit import held_elsewhere
from hostdev.binding.lock import (
    LOCK_PATH,
    BindingLockBusy,
    BindingLockError,
    LockHolder,
    hold_binding_lock,
    parse_lock_holder,
    read_lock_holder,
)
from hostdev.errors import RootNotFound


def test_the_holder_writes_itself_into_the_lock_file_and_clears_it(tmp_path: Path) -> None:
    with hold_binding_lock(tmp_path, 0, who="bind 0000:3b:00.0") as lock:
        assert lock.path == tmp_path / LOCK_PATH
        holder = read_lock_holder(tmp_path)
        assert holder is not None
        assert (holder.pid, holder.doing) == (os.getpid(), "bind 0000:3b:00.0")
        assert holder.since.endswith("Z")
        lock.note("bind 0000:3b:00.0 0000:3b:00.1")
        assert read_lock_holder(tmp_path) == LockHolder(
            os.getpid(), holder.command, "bind 0000:3b:00.0 0000:3b:00.1", holder.since
        )
    assert (tmp_path / LOCK_PATH).read_text() == ""
    assert read_lock_holder(tmp_path) is None


def test_wait_0_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    # flock locks belong to the open file: a second open in the same process is excluded too.
    with (
        hold_binding_lock(tmp_path, 0, who="unbind 0000:3b:00.0"),
        pytest.raises(BindingLockBusy) as caught,
        hold_binding_lock(tmp_path, 0, who="bind 0000:3b:00.0"),
    ):
        pytest.fail("took a lock that is held")
    busy = caught.value
    assert busy.holder is not None
    assert (busy.holder.pid, busy.holder.doing) == (os.getpid(), "unbind 0000:3b:00.0")
    message = str(busy)
    lock_file = tmp_path / LOCK_PATH
    assert message.startswith(f"another binding run holds {lock_file}: pid {os.getpid()} (")
    assert "unbind 0000:3b:00.0, since " in message
    assert "\n" not in message


def test_a_waiter_names_the_other_process_and_gets_the_lock_when_it_lets_go(
    tmp_path: Path,
) -> None:
    seen: list[LockHolder | None] = []
    with (
        held_elsewhere(tmp_path, 0.5, "unbind 0000:3b:00.0") as other,
        hold_binding_lock(tmp_path, 10, who="bind", on_wait=seen.append) as lock,
    ):
        assert 0.2 < lock.waited < 10  # the other holds it for 0.5 s
    assert len(seen) == 1 and seen[0] is not None
    assert (seen[0].pid, seen[0].doing) == (other.pid, "unbind 0000:3b:00.0")
    assert "hostdev.binding.lock" in seen[0].command or seen[0].command.startswith("-c")


def test_the_wait_is_bounded(tmp_path: Path) -> None:
    with (
        held_elsewhere(tmp_path, 30, "bind --from-config") as other,
        pytest.raises(BindingLockBusy) as caught,
        hold_binding_lock(tmp_path, 0.3, who="bind"),
    ):
        pytest.fail("took a lock that is held")
    assert 0.3 <= caught.value.waited < 5
    assert caught.value.holder is not None and caught.value.holder.pid == other.pid
    assert f"after waiting {caught.value.waited:.1f} s: pid {other.pid} (" in str(caught.value)


def test_the_lock_goes_with_a_killed_holder(tmp_path: Path) -> None:
    with held_elsewhere(tmp_path, 30, "bind 0000:3b:00.0") as other:
        other.send_signal(signal.SIGKILL)
        other.wait()
        # Its record is left behind, but the lock is free and the next holder replaces it.
        with hold_binding_lock(tmp_path, 0, who="unbind 0000:3b:00.0"):
            holder = read_lock_holder(tmp_path)
            assert holder is not None and holder.pid == os.getpid()


def test_threads_take_turns(tmp_path: Path) -> None:
    inside = 0
    overlaps: list[int] = []
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside
        for _ in range(20):
            with hold_binding_lock(tmp_path, 10, who="thread"):
                with guard:
                    inside += 1
                    overlaps.append(inside)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [1] * 80


def test_a_missing_root_and_an_unwritable_directory_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(RootNotFound), hold_binding_lock(tmp_path / "nope", 0, who="bind"):
        pytest.fail("locked under a missing root")
    assert not (tmp_path / "nope").exists()
    (tmp_path / "var").mkdir()
    (tmp_path / "var/lib").write_text("a file where the directory should be")
    with (
        pytest.raises(BindingLockError, match=r"cannot open the binding lock .*: Not a directory"),
        hold_binding_lock(tmp_path, 0, who="bind"),
    ):
        pytest.fail("locked without a lock file")


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[1]", '{"pid": "1"}', '{"pid": true}', "[" * 100_000],
    ids=["empty", "garbage", "list", "pid-text", "pid-bool", "deep"],
)
def test_an_unreadable_record_names_no_holder(text: str) -> None:
    assert parse_lock_holder(text) is None


def test_a_record_is_one_short_printable_line() -> None:
    record = {"pid": 7, "command": "evil\nforged line", "doing": "x" * 5000, "since": 3}
    holder = parse_lock_holder(json.dumps(record))
    assert holder is not None
    assert holder.command == "evil?forged line"
    assert len(holder.doing) <= 300 and holder.since == ""
    assert "\n" not in str(holder)
