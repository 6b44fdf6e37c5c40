"""A paged KV cache: a per-layer page pool, a block table per running request, reference-counted pages.

Each layer holds ``k[li], v[li]`` of shape ``[num_pages, page_size, kv_heads, head_dim]``. A running request
(row ``r`` of the scheduler's compact running list) owns the pages listed in ``tables[r]``: token ``t`` of
its context lives at ``page tables[r][t // page_size]``, offset ``t % page_size``. The same table sits on the
device as ``block_table[r]`` (unused entries point at page 0, a scratch page no request owns: rows padded
up to a CUDA-graph batch write their garbage K/V there, and masked positions read it).

Pages are reference counted so the ``n`` samples of one prompt share the prompt's full pages
(``share``): only the partially filled last page is copied, the shared ones are never written again
(decode writes only at positions past the prompt). A page returns to the free list when its last holder
releases it (request finished, aborted, retracted).

Memory is the pool, allocated once (sized by ``--max-total-tokens``, or the slot cache's size capped by free
memory); what a request holds is proportional to its live context, so the scheduler admits by free pages.
"""

from __future__ import annotations

import torch

from miles.utils.logging import get_logger

logger = get_logger("miles.engine.paged_cache")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without the host waiting: pinned, then copied non-blocking (a copy from
    pageable memory may wait for the work queued on the device: with the overlap scheduler, the step in flight)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class OutOfPages(RuntimeError):
    """An allocation the scheduler should have checked first: more pages than are free."""


class PagePool:
    """Free list + reference counts over pages ``1..num_pages-1`` (page 0 is the scratch page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.reset()

    def reset(self) -> None:
        self.ref = [0] * self.num_pages
        self.free: list[int] = list(range(self.num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self.free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfPages(f"{n} pages asked, {len(self.free)} free")
        out = [self.free.pop() for _ in range(n)]
        for p in out:
            self.ref[p] = 1
        return out

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self.ref[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.free.append(p)
            elif self.ref[p] < 0:
                raise RuntimeError(f"page {p} released more often than held")


class PagedKV:
    """The page pools of every layer, the block tables, and the gathers/writes the forward needs."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, num_pages: int, page_size: int, max_rows: int,
                 max_ctx: int, dtype: torch.dtype, device: torch.device, ride_rows: int = 0):
        self.n_layers, self.n_kv, self.head_dim = n_layers, n_kv, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, device
        # rows beyond the running requests': row ``max_rows`` (``chunk_row``) holds a prompt being prefilled in chunks
        # between decode steps; row ``max_rows + 1`` (``scratch_row``) never holds a page (all scratch page 0): the
        # padding tokens of a mixed prefill + decode step write and read there; the ``ride_rows`` after it hold the
        # prompts being prefilled inside decode steps (mixed), one each. Decode (and its graph padding) touches rows
        # below all of them.
        self.max_rows = max_rows + 2 + ride_rows
        self.chunk_row = max_rows
        self.scratch_row = max_rows + 1
        self.ride_rows = list(range(max_rows + 2, max_rows + 2 + ride_rows))
        self.max_pages_per_row = -(-max_ctx // page_size)
        self.pool = PagePool(num_pages)
        self.tables: list[list[int]] = [[] for _ in range(self.max_rows)]
        self.block_table = torch.zeros(self.max_rows, self.max_pages_per_row, dtype=torch.long, device=device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.peak_used = 0

    # ------------------------------------------------------------------ memory
    def bytes(self) -> int:
        el = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.pool.num_pages * self.page_size * self.n_kv * self.head_dim * el

    def allocate(self) -> None:
        shape = (self.pool.num_pages, self.page_size, self.n_kv, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.reset()

    def reset(self) -> None:
        """Every page free and every row's table empty; the pages' contents are left as they are."""
        self.pool.reset()
        self.tables = [[] for _ in range(self.max_rows)]
        self.block_table.zero_()

    def free(self) -> None:
        self.k, self.v = [], []

    # ------------------------------------------------------------------ tables
    def pages_for(self, ntok: int) -> int:
        return -(-ntok // self.page_size)

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.pool.num_used)

    def grow(self, row: int, ntok: int) -> None:
        """Give ``row`` pages for ``ntok`` tokens of context (no-op when it has them). Raises OutOfPages."""
        t = self.tables[row]
        need = self.pages_for(ntok) - len(t)
        if need <= 0:
            return
        new = self.pool.alloc(need)
        self.block_table[row, len(t): len(t) + need] = to_device(torch.tensor(new, dtype=torch.long), self.device)
        t.extend(new)
        self._note_peak()

    def grow_one_page(self, rows: list[int]) -> None:
        """One more page for each of ``rows`` (rows whose next token starts a page); one device write."""
        if not rows:
            return
        new = self.pool.alloc(len(rows))
        cols = []
        for r, p in zip(rows, new):
            cols.append(len(self.tables[r]))
            self.tables[r].append(p)
        idx = to_device(torch.tensor([rows, cols, new], dtype=torch.long), self.device)
        self.block_table[idx[0], idx[1]] = idx[2]
        self._note_peak()

    def release(self, row: int) -> None:
        t = self.tables[row]
        if t:
            self.pool.release(t)
            self.block_table[row, : len(t)] = 0
            self.tables[row] = []

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s pages now belong to row ``dst`` (``dst`` must hold none): a table copy, no KV copy."""
        if self.tables[dst]:
            raise RuntimeError(f"row {dst} still holds pages")
        n = len(self.tables[src])
        self.tables[dst], self.tables[src] = self.tables[src], []
        if n:
            self.block_table[dst, :n] = self.block_table[src, :n]
            self.block_table[src, :n] = 0

    def share(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` gets row ``src``'s first ``length`` tokens: full pages shared, the partial one copied."""
        if self.tables[dst]:
            raise RuntimeError(f"row {dst} still holds pages")
        full = length // self.page_size
        pages = self.tables[src][:full]
        self.pool.share(pages)
        own = pages + (self.pool.alloc(1) if length % self.page_size else [])
        if len(own) > full:
            part, copy = self.tables[src][full], own[full]
            for kc, vc in zip(self.k, self.v):
                kc[copy].copy_(kc[part])
                vc[copy].copy_(vc[part])
        self.tables[dst] = own
        if own:
            self.block_table[dst, : len(own)] = to_device(torch.tensor(own, dtype=torch.long), self.device)
        self._note_peak()

    # ------------------------------------------------------------------ forward helpers
    def prefill_index(self, row_start: int, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat (batch row, token, page, offset) indices of every prompt token of rows ``row_start..``."""
        ps, parts = self.page_size, []
        for i, n in enumerate(lens):
            j = torch.arange(n)
            table = torch.tensor(self.tables[row_start + i], dtype=torch.long)
            parts.append(torch.stack([torch.full((n,), i, dtype=torch.long), j, table[j // ps], j % ps]))
        idx = torch.cat(parts, 1).to(self.device, non_blocking=True)
        return idx[0], idx[1], idx[2], idx[3]

    def gather_row(self, li: int, row: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s first ``L`` positions (a multiple of page_size) as ``[1, kv_heads, L, head_dim]``."""
        bt = self.block_table[row, : L // self.page_size]
        k = self.k[li].view(self.k[li].shape[0], -1).index_select(0, bt).view(1, L, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v[li].view(self.v[li].shape[0], -1).index_select(0, bt).view(1, L, self.n_kv, self.head_dim).transpose(1, 2)
        return k, v

    def gather(self, li: int, B: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``0..B-1``'s first ``L`` positions (a multiple of page_size) as ``[B, kv_heads, L, head_dim]`` views."""
        bt = self.block_table[:B, : L // self.page_size].reshape(-1)
        k = self.k[li].view(self.k[li].shape[0], -1).index_select(0, bt).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v[li].view(self.v[li].shape[0], -1).index_select(0, bt).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        return k, v
