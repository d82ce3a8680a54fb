"""The upload screen tests G's magnitude and sign inside its Cauchy–Schwarz pass, chunk by chunk
(issue 30): an entry anywhere, in any chunk, is refused with the reason the full check gives."""

from __future__ import annotations

import itertools

import pytest
import torch

import fcl_flower.analytic.checks as checks
from fcl_flower.analytic.checks import StatisticsRejected, check_packed_statistics, screen_packed_statistics
from fcl_flower.analytic.packing import pack_upper, packed_length, row_offset

DIM = 40


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 packed entries: a 40-feature upload is screened in 13 passes."""
    monkeypatch.setattr(checks, "_SCREEN_CHUNK", 64)
    checks._screen_chunks.cache_clear()
    yield
    checks._screen_chunks.cache_clear()


def upload(empty: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed float32 G, C and counts of random ReLU features, the first ``empty`` never active."""
    generator = torch.Generator().manual_seed(3)
    phi = torch.relu(torch.randn(30, DIM, generator=generator, dtype=torch.float64))
    phi[:, :empty] = 0.0
    y = torch.nn.functional.one_hot(torch.randint(0, 2, (30,), generator=generator), 2).to(torch.float64)
    return pack_upper(phi.T @ phi).to(torch.float32), phi.T @ y, y.sum(0)


def first_entry_of_row(row: int) -> int:
    return row_offset(row, DIM) + 1  # G[row, row + 1]: off the diagonal


OPTIONS = {"relative_tolerance": 2.0**-24, "nonnegative": True}
PLACES = {
    "first chunk": first_entry_of_row(0),
    "middle": first_entry_of_row(DIM // 2),
    "last chunk": packed_length(DIM) - 2,
}
VALUES = {
    "nan": (float("nan"), "G contains NaN or inf"),
    "+inf": (float("inf"), "G contains NaN or inf"),
    "-inf": (float("-inf"), "G contains NaN or inf"),
    "huge": (2e38, None),  # within float32 (its largest is 3.4e38), so within 1e150: Cauchy–Schwarz decides
    "negative": (-1.0, "G or the class sums have negative entries"),
}


def test_the_chunks_cover_the_packed_upload_once() -> None:
    chunks = checks._screen_chunks(DIM)
    assert len(chunks) > 10
    assert chunks[0][2] == 0 and chunks[-1][3] == packed_length(DIM)
    assert all(left[3] == right[2] for left, right in itertools.pairwise(chunks))


@pytest.mark.parametrize("empty", [0, 5], ids=["all features", "five empty features"])
@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("value", sorted(VALUES))
def test_one_bad_entry_anywhere_gets_the_full_checks_reason(empty: int, place: str, value: str) -> None:
    g, c, n = upload(empty)
    screen_packed_statistics(g, c, n, **OPTIONS)  # the honest upload passes
    bad, reason = VALUES[value]
    g[PLACES[place]] = bad
    with pytest.raises(StatisticsRejected) as full:
        check_packed_statistics(g.to(torch.float64), c, n, **OPTIONS)
    with pytest.raises(StatisticsRejected) as screened:
        screen_packed_statistics(g, c, n, **OPTIONS)
    assert str(screened.value) == str(full.value)
    if reason is not None:
        assert str(screened.value).startswith(reason)


def test_a_huge_float64_entry_is_refused_for_its_magnitude() -> None:
    g, c, n = upload()
    g64 = g.to(torch.float64)
    g64[PLACES["last chunk"]] = 2e150
    with pytest.raises(StatisticsRejected, match=r"G has an entry of magnitude 2e\+150 > 1e\+150"):
        screen_packed_statistics(g64, c, n, relative_tolerance=2.0**-24, nonnegative=True)


def test_a_nan_beside_a_zero_energy_breach_is_named_as_nan() -> None:
    """Two faults: the magnitude test's reason comes first, as in the full check."""
    g, c, n = upload(empty=5)
    g[first_entry_of_row(0)] = 1.0  # a non-zero entry in an empty feature's row
    g[PLACES["last chunk"]] = float("nan")
    with pytest.raises(StatisticsRejected, match="G contains NaN or inf"):
        screen_packed_statistics(g, c, n, **OPTIONS)
