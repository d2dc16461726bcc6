"""CellLedger against a brute-force model of llama.cpp's unified KV cache: every cell an
object, ``seq_cp`` adds the destination to the source's cells, ``seq_rm`` takes the
sequence off its cells, a cell no sequence holds is free."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference.core.cells import CellLedger

SEQS = 4


class _Cache:
    def __init__(self) -> None:
        self.cells: list[set[int]] = []  # one set of holders per cell ever made

    def positions(self, seq: int) -> list[int]:
        return [i for i, holders in enumerate(self.cells) if seq in holders]

    def append(self, seq: int, n: int) -> None:
        self.cells += [{seq} for _ in range(n)]

    def copy(self, src: int, dst: int, k: int) -> None:
        self.remove(dst)
        for i in self.positions(src)[:k]:
            self.cells[i].add(dst)

    def truncate(self, seq: int, length: int) -> None:
        for i in self.positions(seq)[length:]:
            self.cells[i].discard(seq)

    def remove(self, seq: int) -> None:
        for holders in self.cells:
            holders.discard(seq)

    def used(self) -> int:
        return sum(1 for holders in self.cells if holders)


_op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, SEQS - 1), st.integers(0, 40)),
    st.tuples(st.just("copy"), st.integers(0, SEQS - 1), st.integers(0, SEQS - 1),
              st.integers(0, 60)),
    st.tuples(st.just("truncate"), st.integers(0, SEQS - 1), st.integers(0, 60)),
    st.tuples(st.just("remove"), st.integers(0, SEQS - 1)),
)


@settings(max_examples=400)
@given(st.lists(_op, max_size=40))
def test_used_cells_match_a_cell_by_cell_model(ops):
    ledger, cache = CellLedger(), _Cache()
    for op in ops:
        if op[0] == "copy" and op[1] == op[2]:
            continue  # the engine never copies a sequence onto itself
        getattr(ledger, op[0])(*op[1:])
        getattr(cache, op[0])(*op[1:])
        assert ledger.used() == cache.used(), op
        for seq in range(SEQS):
            assert ledger.length(seq) == len(cache.positions(seq))


def test_a_copied_prefix_counts_once_and_outlives_its_source():
    # the engine's case: a request copies the running one's prefix, the source finishes and
    # its sequence is emptied; the copy still holds (and the cache still uses) those cells
    ledger = CellLedger()
    ledger.append(0, 1470)
    ledger.copy(0, 1, 1470)
    ledger.append(1, 34)
    assert ledger.used() == 1504
    ledger.remove(0)
    assert ledger.used() == 1504
    ledger.truncate(1, 1470)
    ledger.append(1, 2)
    assert ledger.used() == 1472 and ledger.length(1) == 1472
