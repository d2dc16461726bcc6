"""Which KV cells of a unified llama.cpp cache are in use, with cells shared between
sequences (pure).

Throughput mode keeps several sequences in one unified KV cache, and
``llama_memory_seq_cp(src, dst, 0, k)`` makes ``dst`` hold the *same* cells as the first
``k`` positions of ``src``: a shared prefix costs its cells once. Admission must know how
many cells are held, and llama.cpp 0.3.x has no call that says so. Counting each request's
own cells and subtracting what it copied goes wrong as soon as the source's sequence is
removed: the copied cells stay (the copy holds them) but nobody counts them any more, the
engine admits more than fits, and ``llama_decode`` fails for every running request
(measured: 8 clients on a 1,470-token prefix, ``n_ctx`` 8192).

:class:`CellLedger` mirrors the cache instead. A sequence holds a list of *runs*: cells
one sequence computed or restored in one go, in position order. A copy holds prefixes of
the source's runs, so the cells of a run in use are the most any holder holds of it, and
:meth:`CellLedger.used` is the sum of that over the runs. The engine calls the ledger
wherever it calls llama.cpp's memory functions.
"""

from __future__ import annotations

__all__ = ["CellLedger"]


class CellLedger:
    """Cells held per sequence, shared cells counted once (module docstring)."""

    def __init__(self) -> None:
        self._held: dict[int, list[list[int]]] = {}  # seq -> [[run id, cells held], ...]
        self._next_run = 0

    def length(self, seq: int) -> int:
        """Positions ``seq`` holds (its cells, shared or not)."""
        return sum(n for _, n in self._held.get(seq, ()))

    def append(self, seq: int, n: int) -> None:
        """``seq`` gets ``n`` new cells after its last position (decoded or restored)."""
        if n <= 0:
            return
        runs = self._held.setdefault(seq, [])
        if runs and self._holds_most(seq, runs[-1]):
            runs[-1][1] += n
            return
        runs.append([self._next_run, n])
        self._next_run += 1

    def _holds_most(self, seq: int, last: list[int]) -> bool:
        """Whether no other sequence holds more of ``seq``'s last run: then new cells can
        extend the run (the others still hold prefixes of it); else a holder of more of it
        has other cells at those positions, and the new cells are a run of their own."""
        run, n = last
        return all(m <= n for other, runs in self._held.items() if other != seq
                   for r, m in runs if r == run)

    def copy(self, src: int, dst: int, k: int) -> None:
        """``llama_memory_seq_cp(src, dst, 0, k)`` on an empty ``dst``: it holds the
        source's first ``k`` positions, the same cells."""
        self.remove(dst)
        self._set(dst, _first(self._held.get(src, ()), k))

    def truncate(self, seq: int, length: int) -> None:
        """``llama_memory_seq_rm(seq, length, -1)``: ``seq`` keeps its first ``length``."""
        self._set(seq, _first(self._held.get(seq, ()), length))

    def _set(self, seq: int, runs: list[list[int]]) -> None:
        if runs:
            self._held[seq] = runs
        else:
            self._held.pop(seq, None)

    def remove(self, seq: int) -> None:
        """``llama_memory_seq_rm(seq, -1, -1)``."""
        self._held.pop(seq, None)

    def used(self) -> int:
        """Cells in use: per run, the most any sequence holds of it."""
        most: dict[int, int] = {}
        for runs in self._held.values():
            for run, n in runs:
                if n > most.get(run, 0):
                    most[run] = n
        return sum(most.values())


def _first(runs, length: int) -> list[list[int]]:
    """The runs that make up the first ``length`` positions of ``runs`` (new lists)."""
    out, left = [], length
    for run, n in runs:
        if left <= 0:
            break
        out.append([run, min(n, left)])
        left -= n
    return out
