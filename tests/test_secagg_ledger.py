"""A node's secure-aggregation ledger (clients/ledger.py): each input is opened once.

Every edge a SuperNode meets: a restart between stages (a fresh process reads what the last one
wrote), a damaged or foreign file (refuses, one line, nothing revealed), two runs and two
federations on one node (never collide), the digest rule across runs, where the file lives and
with which permissions, and the client handler that refuses before it reveals.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from clients.ledger import ENV, FORMAT, Ledger, input_digest, ledger_folder
from fcl_flower.privacy.secagg import SecureAggregationError

VIEW, OTHER = [1, 2, 3, 4], [1, 2, 3]


def ledger(folder: Path, federation: str = "fed", node: int = 7) -> Ledger:
    return Ledger(folder, federation, node)


def test_a_stage_opens_again_only_over_the_identical_set(tmp_path) -> None:
    book = ledger(tmp_path)
    book.record("run-a", [0], VIEW)
    book.record("run-a", [0], list(reversed(VIEW)))  # the same set, in any order: nothing new is learnt
    assert book.contributed("run-a", 0) == VIEW
    with pytest.raises(SecureAggregationError) as info:
        book.record("run-a", [0], OTHER)
    assert str(info.value) == (
        "stage 1 was already opened over nodes [1, 2, 3, 4]; it is not contributed again over [1, 2, 3]: refused"
    )
    with pytest.raises(SecureAggregationError, match="stage 1 was already opened"):
        book.check("run-a", [1, 0], OTHER)  # any task of the upload
    assert book.contributed("run-a", 0) == VIEW  # a refusal writes nothing
    assert book.contributed("run-a", 1) is None


def test_the_ledger_survives_a_restart(tmp_path) -> None:
    """A SuperNode restart is a new process with an empty context: the file is what remains."""
    ledger(tmp_path).record("run-a", [0, 2], VIEW)
    again = ledger(tmp_path)  # what the next process builds from the same node config
    assert again.contributed("run-a", 2) == VIEW
    with pytest.raises(SecureAggregationError, match="stage 3 was already opened"):
        again.check("run-a", [2], OTHER)


def test_two_runs_and_two_federations_never_collide(tmp_path) -> None:
    ledger(tmp_path).record("run-a", [0], VIEW)
    ledger(tmp_path).record("run-b", [0], OTHER)  # another run: its own entries
    ledger(tmp_path, federation="other").record("run-a", [0], OTHER)  # another federation: another file
    ledger(tmp_path, node=8).record("run-a", [0], OTHER)  # another node on the same machine
    assert ledger(tmp_path).contributed("run-a", 0) == VIEW
    assert ledger(tmp_path).contributed("run-b", 0) == OTHER
    assert len({ledger(tmp_path).path, ledger(tmp_path, "other").path, ledger(tmp_path, node=8).path}) == 3


def test_the_same_statistics_are_refused_over_another_set_in_any_run(tmp_path) -> None:
    """Signed-keys mode: a server that names a new run id to re-open the same statistics over a
    smaller set (a "resume" that leaves the victim out) is refused by the digest."""
    digest = input_digest(b"G", b"C", b"n")
    ledger(tmp_path).record("run-a", [0], VIEW, {0: digest})
    with pytest.raises(SecureAggregationError) as info:
        ledger(tmp_path).check("run-claimed-new", [0], OTHER, {0: digest})
    assert "the statistics of stage 1 were already opened over nodes [1, 2, 3, 4] (in this or another run)" in str(
        info.value
    )
    ledger(tmp_path).record("run-claimed-new", [0], VIEW, {0: digest})  # the identical set: allowed
    ledger(tmp_path).record("run-c", [0], OTHER, {0: input_digest(b"G'", b"C", b"n")})  # other statistics


def test_input_digest_frames_its_parts() -> None:
    assert input_digest(b"ab", b"c") != input_digest(b"a", b"bc")
    assert input_digest(b"ab", b"c") == input_digest(b"ab", b"c")


@pytest.mark.parametrize(
    "content, reason",
    [
        ("{not json", "is unreadable (JSONDecodeError): refusing to reveal"),
        (json.dumps({"format": "other", "runs": {}, "inputs": {}}), "is damaged: refusing to reveal"),
        (json.dumps({"format": FORMAT, "runs": [], "inputs": {}}), "is damaged: refusing to reveal"),
        (json.dumps({"format": FORMAT, "runs": {"r": {"0": "x"}}, "inputs": {}}), "is damaged: refusing to reveal"),
        (json.dumps({"format": FORMAT, "runs": {}, "inputs": {"d": 5}}), "is damaged: refusing to reveal"),
        ("[" * 100000 + "]" * 100000, "is unreadable (RecursionError): refusing to reveal"),
    ],
    ids=["json", "format", "runs", "view", "inputs", "deep"],
)
def test_a_damaged_ledger_refuses_with_one_line(tmp_path, content, reason) -> None:
    book = ledger(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    book.path.write_text(content)
    for call in (lambda: book.check("run-a", [0], VIEW), lambda: book.record("run-a", [0], VIEW)):
        with pytest.raises(SecureAggregationError) as info:
            call()
        assert str(info.value) == f"secure-aggregation ledger {book.path} {reason}"
    assert book.path.read_text() == content  # never overwritten


def test_a_ledger_that_is_a_symlink_is_refused(tmp_path) -> None:
    book = ledger(tmp_path / "ledger")
    book.folder.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": FORMAT, "runs": {}, "inputs": {}}))
    book.path.symlink_to(target)
    with pytest.raises(SecureAggregationError, match="is not a regular file: refusing to reveal"):
        book.record("run-a", [0], VIEW)


def test_the_file_is_written_atomically_and_private(tmp_path) -> None:
    book = ledger(tmp_path / "state" / "ledger")
    book.record("run-a", [0], VIEW)
    assert stat.S_IMODE(os.stat(book.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(book.folder).st_mode) == 0o700
    assert [p.name for p in book.folder.iterdir() if p.name.startswith(".ledger-")] == []  # no temporary left
    data = json.loads(book.path.read_text())
    assert data == {"format": FORMAT, "runs": {"run-a": {"0": VIEW}}, "inputs": {}}


def test_where_the_ledger_lives(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "env"))
    assert ledger_folder({"secagg-ledger": str(tmp_path / "node")}) == tmp_path / "node"
    assert ledger_folder({}) == tmp_path / "env"
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert ledger_folder({}) == tmp_path / "xdg" / "fcl-flower" / "secagg-ledger"
