"""Request slots, the paged KV cache and its page allocator.

Slot numbering: token slot s lives in page s // page_size at offset s % page_size. Page 0 is
reserved: its slot 0 is the dummy slot that padded rows of a captured graph write into, so a
padded row can never touch a live request's KV.
"""

from __future__ import annotations

import mmap

import torch

DUMMY_SLOT = 0
DUMMY_PAGE = 0


class ReqToTokenPool:
    """Maps a request slot to the KV slot of each of its tokens: the source of block tables."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        # [size, max_context_len] int32; entries past a request's length are stale or 0.
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self._free = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot; check can_allocate() first")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"request slot {slot} freed twice")
        self._free.append(slot)


# An int8 cache row of one head: head_dim int8 values, then their float32 scale (4 bytes).
INT8_SCALE_BYTES = 4


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row in a cache of `dtype` (int8 rows carry their scale)."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def kv_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, heads, D] K or V as a cache of `dtype` holds them: cast, or for int8 each head's
    values and scale (symmetric, scale = max|x| / 127; the C++ operator the decode write uses
    too, so every path stores the same bytes)."""
    if dtype != torch.int8:
        return x.to(dtype)
    from airserve.srt.layers import cpu_kernels

    if x.device.type != "cpu" or not cpu_kernels.available():
        raise RuntimeError("--kv-cache-dtype int8 needs airserve's C++ CPU kernels on the host "
                           "CPU (they did not build here: see the log); choose float16")
    return torch.ops.airserve.quantize_kv_cpu(x.float())


def kv_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., heads, width] as values of `dtype` [..., heads, D]: the inverse of
    `kv_rows` (an int8 row's values times its scale; other caches a cast)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    d = rows.shape[-1] - INT8_SCALE_BYTES
    scales = rows[..., d:].contiguous().view(torch.float32)  # [..., heads, 1]
    return rows[..., :d].to(dtype) * scales.to(dtype)


class TokenToKVPool:
    """Per-layer K and V tensors, allocated once: [num_pages * page_size, kv_heads, width],
    width = head_dim (an int8 cache: head_dim + 4, each row's scale after its values)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.head_dim = head_dim
        shape = (self.num_slots, num_kv_heads, kv_row_width(head_dim, dtype))
        # Zeroed, not empty: attention reads padded positions (masked) and 0 * NaN would leak.
        zeros = _lazy_zeros if torch.device(device).type == "cpu" else torch.zeros
        self.k_buffers = [zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return (2 * num_layers * num_kv_heads * kv_row_width(head_dim, dtype)
                * torch.tensor([], dtype=dtype).itemsize)

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
                ) -> torch.Tensor:
    """A zero CPU tensor in anonymous mapped memory: zero by definition, and resident only as
    far as it has been written (torch.zeros writes every byte up front). The allocator hands
    out the lowest free pages first, so a pool's resident size follows the KV in use (plus
    what the prefix cache keeps), not the pool's capacity."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor keeps a reference to the mapping (torch.frombuffer), so it lives as long.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class PagedAllocator:
    """Hands out whole pages to requests and writes their slots into `req_to_token`.

    A request owns pages, never single slots, so a free page is always usable by anyone:
    allocation cannot fail from fragmentation while enough pages are free.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is the reserved dummy page)")
        self.req_to_token = req_to_token_pool.req_to_token
        self.page_size = page_size
        self.num_pages = num_pages
        self._free_pages = list(range(num_pages - 1, DUMMY_PAGE, -1))

    @property
    def total_usable_pages(self) -> int:
        return self.num_pages - 1

    def available_pages(self) -> int:
        return len(self._free_pages)

    def available_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def pages_needed(self, cur_len: int, new_len: int) -> int:
        p = self.page_size
        return -(-new_len // p) - (-(-cur_len // p))

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free_pages)

    def allocate(self, req_slot: int, cur_len: int, new_len: int) -> torch.Tensor:
        """Give request `req_slot` the slots for token positions [cur_len, new_len).

        Returns those slots (out_cache_loc) as an int64 tensor of length new_len - cur_len.
        """
        n = self.pages_needed(cur_len, new_len)
        if n > len(self._free_pages):
            raise RuntimeError(f"need {n} KV pages, {len(self._free_pages)} free")
        row = self.req_to_token[req_slot]
        p = self.page_size
        if n:
            first_new_page = -(-cur_len // p)
            pages = torch.tensor([self._free_pages.pop() for _ in range(n)], dtype=torch.int32)
            slots = (pages[:, None] * p + torch.arange(p, dtype=torch.int32)).flatten()
            row[first_new_page * p:first_new_page * p + n * p] = slots.to(row.device)
        return row[cur_len:new_len].to(torch.int64)

    def allocate_next(self, req_slots: list[int], cur_lens: list[int]) -> torch.Tensor:
        """One more position for each of several requests (a decode step): request
        `req_slots[i]` gets the slot of position `cur_lens[i]`, on a new page where that
        position starts one. The same pages, in the same order, as `allocate(slot, n, n + 1)`
        per request; one tensor operation for all of them. Returns the slots [len] int64."""
        p = self.page_size
        new = [i for i, n in enumerate(cur_lens) if n % p == 0]
        if len(new) > len(self._free_pages):
            raise RuntimeError(f"need {len(new)} KV pages, {len(self._free_pages)} free")
        table = self.req_to_token
        if new:
            dev = table.device
            pages = torch.tensor([self._free_pages.pop() for _ in new], dtype=torch.int32,
                                 device=dev)
            rows = torch.tensor([req_slots[i] for i in new], dtype=torch.int64, device=dev)
            starts = torch.tensor([cur_lens[i] for i in new], dtype=torch.int64, device=dev)
            span = torch.arange(p, device=dev)
            table[rows[:, None], starts[:, None] + span] = pages[:, None] * p + span.to(
                torch.int32)
        rows = torch.tensor(req_slots, dtype=torch.int64, device=table.device)
        cols = torch.tensor(cur_lens, dtype=torch.int64, device=table.device)
        return table[rows, cols].to(torch.int64)

    def free(self, req_slot: int, seq_len: int) -> None:
        """Return every page of request `req_slot` that holds its first `seq_len` tokens."""
        if seq_len <= 0:
            return
        p = self.page_size
        pages = (self.req_to_token[req_slot, 0:seq_len:p] // p).tolist()
        if DUMMY_PAGE in pages:
            raise RuntimeError(f"request slot {req_slot} claims the reserved dummy page")
        self._free_pages.extend(reversed(pages))

    def free_slots(self, slots: torch.Tensor) -> None:
        """Return the pages holding `slots`: consecutive positions of one request starting at a
        page boundary (the last page may be partly used)."""
        p = self.page_size
        pages = (slots[::p] // p).tolist()
        if DUMMY_PAGE in pages:
            raise RuntimeError("freeing the reserved dummy page")
        self._free_pages.extend(reversed(pages))

    def row_slots(self, req_slot: int, start: int, end: int) -> torch.Tensor:
        """KV slots of token positions [start, end) of request `req_slot`: [end - start] int64."""
        return self.req_to_token[req_slot, start:end].to(torch.int64).cpu()

    def assign(self, req_slot: int, slots: torch.Tensor) -> None:
        """Point the first len(slots) positions of request `req_slot` at cached slots (pages
        it shares, not owns)."""
        row = self.req_to_token[req_slot]
        row[:len(slots)] = slots.to(device=row.device, dtype=row.dtype)

    def block_table(self, req_slots: torch.Tensor, max_blocks: int) -> torch.Tensor:
        """[len(req_slots), max_blocks] int32 page ids: the block table of those requests."""
        p = self.page_size
        columns = self.req_to_token[req_slots, : max_blocks * p : p]
        return columns if p == 1 else columns // p
