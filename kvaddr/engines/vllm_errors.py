"""The vLLM step's device error bits, its first-bad record and its exception.

The bits are the vLLM step's own (not those of :mod:`kvaddr.errors`): the step
checks more than the core step does. A step records the OR of every bit it set
and, for its first bad value, a 64-bit key ordered by token, then request,
group and bit:

    key = token << 32 | request << 8 | group << 5 | log2(bit)

``token`` is the token index for per-token errors; for per-request errors it is
``query_start_loc[b]`` clamped to ``[0, 2**31 - 1]`` (``max_num_batched_tokens``
for :data:`VERR_CAPACITY`). ``request`` is the batch index b (24 bits, so at most
``2**24 - 1`` requests). ``group`` is the KV-cache group (0 when the error
concerns no group).
"""

from __future__ import annotations

from kvaddr.errors import KvaddrError

#: Block index (``pos // B``, or the virtual block under DCP) >= the table's width.
VERR_BLOCK_INDEX = 1
#: Negative (unallocated) block id for a real token.
VERR_NEGATIVE_BLOCK = 2
#: A ``query_start_loc`` entry past ``max_num_batched_tokens``; tokens past it are dropped.
VERR_CAPACITY = 4
#: ``query_start_loc`` decreasing (``qsl[b+1] < qsl[b]``) or negative: request b is skipped.
VERR_QUERY_START_LOC = 8
#: Block index >= ``num_blocks_g[r]`` (within the width): the block was never allocated.
VERR_PAST_NUM_BLOCKS = 16
#: ``idx_mapping[b]`` < -1 or >= ``max_num_reqs``: request b is skipped, its row never read.
VERR_ROW_INDEX = 32
#: ``num_blocks_g[r]`` < 0 or > the width: the gather copies ``clamp(n, 0, width)`` entries.
VERR_NUM_BLOCKS = 64
#: Negative ``num_computed_tokens[r]``: request b is skipped.
VERR_NEGATIVE_COMPUTED = 128
#: An int32 slot mapping was asked for and the slot is > 2**31 - 1: -1 is written instead.
VERR_SLOT_INT32 = 256
#: Attention metadata (``attention`` includes "flashinfer"): a group's ``kv_indices`` needs more
#: entries than ``kv_indices_capacity``; entries past the capacity are dropped.
VERR_KV_INDICES_CAPACITY = 512

VLLM_ERROR_REASONS = {
    VERR_BLOCK_INDEX: "block index beyond the block table's width",
    VERR_NEGATIVE_BLOCK: "negative (unallocated) block id for a real token",
    VERR_CAPACITY: "query_start_loc past max_num_batched_tokens",
    VERR_QUERY_START_LOC: "query_start_loc decreasing or negative",
    VERR_PAST_NUM_BLOCKS: "block index beyond num_blocks of the request's row",
    VERR_ROW_INDEX: "idx_mapping entry outside [-1, max_num_reqs)",
    VERR_NUM_BLOCKS: "num_blocks outside [0, width]",
    VERR_NEGATIVE_COMPUTED: "negative num_computed_tokens",
    VERR_SLOT_INT32: "slot does not fit the int32 slot mapping",
    VERR_KV_INDICES_CAPACITY: "kv_indices needs more entries than kv_indices_capacity",
}

#: Bits whose key names a KV-cache group.
GROUP_BITS = (
    VERR_BLOCK_INDEX
    | VERR_NEGATIVE_BLOCK
    | VERR_PAST_NUM_BLOCKS
    | VERR_NUM_BLOCKS
    | VERR_SLOT_INT32
    | VERR_KV_INDICES_CAPACITY
)

#: Key of "no error" (all ones).
VLLM_NO_ERROR_KEY = (1 << 64) - 1

#: The most requests a key can name.
VLLM_MAX_REQUESTS = 1 << 24


def vllm_error_key(token: int, request: int, group: int, bit: int) -> int:
    """The record key of one error: ``token << 32 | request << 8 | group << 5 | log2(bit)``."""
    return (int(token) << 32) | (int(request) << 8) | (int(group) << 5) | (int(bit).bit_length() - 1)


def decode_vllm_error_key(key: int) -> tuple[int, int, int, int]:
    """Inverse of :func:`vllm_error_key`: ``(token, request, group, bit)``."""
    key = int(key)
    return key >> 32, (key >> 8) & ((1 << 24) - 1), (key >> 5) & 7, 1 << (key & 31)


class VllmAddressingError(KvaddrError):
    """A vLLM step's inputs held bad values (raised by ``check()``).

    Attributes
    ----------
    mask : int
        OR of every error bit the step set (:data:`VLLM_ERROR_REASONS`).
    token, request, group, bit : int
        The first bad value's token (see the module docstring), batch index,
        KV-cache group and bit.
    """

    def __init__(self, mask: int, key: int):
        self.mask = int(mask)
        self.key = int(key)
        self.token, self.request, self.group, self.bit = decode_vllm_error_key(key)
        reasons = ", ".join(f"{b} ({VLLM_ERROR_REASONS[b]})" for b in sorted(VLLM_ERROR_REASONS) if self.mask & b)
        where = f"token {self.token} of request {self.request}"
        if self.bit & GROUP_BITS:
            where += f", group {self.group}"
        reason = VLLM_ERROR_REASONS.get(self.bit, f"bit {self.bit}")
        super().__init__(
            f"bad vLLM step input: first bad value at {where}: {reason}; error bits {self.mask}: {reasons}"
        )
