"""exporters/capture/ragged.py: data-dependent split sizes at a static capacity (issue 42).

The shims a token-moving dispatcher is captured with must give torch's values on the rows a real
run has: `repeat_interleave` at its static size, and `.tolist()` of counts kept as tensors. (The
ragged exchange itself, `refine::all_to_all_v`, is checked end to end against torch by
tests/test_transformers_ep.py's AllToAllEP exports.)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from refine.exporters.capture.ragged import SplitSizes, repeated_at_size, static_splits  # noqa: E402


@pytest.mark.parametrize("seed", range(6))
def test_repeat_interleave_at_static_size_is_torch_s_on_the_real_rows(seed: int) -> None:
    """values.repeat_interleave(repeats, output_size=n) at a capacity n >= the total: torch's rows
    first (empty groups, a zero total too), then the last value in every padding row."""
    gen = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 7, (1,), generator=gen))
    values = torch.randint(0, 50, (groups,), generator=gen)
    repeats = torch.randint(0, 4, (groups,), generator=gen)
    total = int(repeats.sum())
    capacity = total + int(torch.randint(0, 5, (1,), generator=gen))
    got = repeated_at_size(values, repeats, output_size=capacity)
    assert got.shape == (capacity,)
    assert torch.equal(got[:total], torch.repeat_interleave(values, repeats))
    assert (got[total:] == values[-1]).all()


def test_other_repeat_interleaves_are_torch_s() -> None:
    """An integer repeat, or no output size, is left to torch."""
    values = torch.tensor([3, 1, 2])
    assert torch.equal(repeated_at_size(values, 2), torch.repeat_interleave(values, 2))
    assert torch.equal(repeated_at_size(values, torch.tensor([1, 0, 2])), torch.tensor([3, 2, 2]))


def test_counts_read_back_inside_the_block_stay_tensors() -> None:
    """Inside static_splits, `.tolist()` of integer counts gives split sizes holding the bound once
    per entry and the counts themselves (a row each of a 2-D tensor); a float tensor's is refused;
    after the block `.tolist()` and `repeat_interleave` are torch's again."""
    counts = torch.tensor([[1, 2], [3, 4]])
    with static_splits(5):
        sizes = counts.tolist()
        assert all(isinstance(s, SplitSizes) for s in sizes) and sizes == [[5, 5], [5, 5]]
        assert torch.equal(sizes[1].counts, counts[1]) and sum(sizes[0]) == 10
        with pytest.raises(TypeError, match="only the integer counts"):
            torch.tensor([0.5]).tolist()
    assert counts.tolist() == [[1, 2], [3, 4]] and type(counts.tolist()) is list
    assert torch.equal(torch.tensor([7]).repeat_interleave(torch.tensor([2]), output_size=2), torch.tensor([7, 7]))
