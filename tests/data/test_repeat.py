"""`repeat_reads`: each read batch serves several optimizer steps, and a resume at any cursor continues
exactly where an uninterrupted run is (fntrain.data.repeat)."""

from __future__ import annotations

import pytest

from fntrain.data.repeat import repeat_reads


class BatchSource:
    """A data function over batches "e{epoch}b{i}", recording what it was asked for and whether it closed."""

    def __init__(self, batches: int = 3):
        self.batches, self.asked, self.closed = batches, [], 0

    def __call__(self, epoch: int, cursor: int):
        self.asked.append((epoch, cursor))
        try:
            for index in range(cursor, self.batches):
                yield f"e{epoch}b{index}"
        finally:
            self.closed += 1


def test_each_batch_is_yielded_once_per_step_it_serves():
    assert list(repeat_reads(BatchSource(), 2)(0, 0)) == ["e0b0", "e0b0", "e0b1", "e0b1", "e0b2", "e0b2"]


@pytest.mark.parametrize("cursor", range(7))
def test_a_resume_at_any_cursor_continues_the_uninterrupted_sequence(cursor):
    whole = list(repeat_reads(BatchSource(), 3)(1, 0))
    source = BatchSource()
    assert list(repeat_reads(source, 3)(1, cursor)) == whole[cursor:]
    assert source.asked == [(1, cursor // 3)]  # nothing before the resumed batch is read


def test_one_step_per_batch_is_the_data_itself():
    source = BatchSource()
    assert repeat_reads(source, 1) is source


def test_closing_closes_the_inner_iterator_and_bad_steps_are_refused():
    source = BatchSource()
    iterator = repeat_reads(source, 2)(0, 0)
    next(iterator)
    iterator.close()
    assert source.closed == 1
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        repeat_reads(source, 0)
