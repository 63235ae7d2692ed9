"""BoundVllmStep: the vLLM step bound once to vLLM's persistent request state.

vLLM keeps the request state (``num_computed_tokens``, each KV-cache group's block table and
``num_blocks``) in persistent device buffers, the same objects every step, while the batch
(``idx_mapping``, ``query_start_loc``) is a new slice every step, so
:meth:`VllmStepPlanner.compute <kvaddr.engines.vllm.VllmStepPlanner.compute>`'s memo of
checked inputs never hits for it. :meth:`VllmStepPlanner.bind
<kvaddr.engines.vllm.VllmStepPlanner.bind>` checks the request state once (exactly as
``compute()`` does), writes its pointers and strides into a private copy of the planner's
kernel parameter block, and returns a :class:`BoundVllmStep`. :meth:`BoundVllmStep.launch`
then takes the step's ``idx_mapping``, ``query_start_loc``, ``num_reqs_padded`` and stream:
it checks the two arrays in full (dtype, shape, contiguity, device, ``num_reqs <=
max_num_reqs``: the same checks and messages as ``compute()``), compares the bound arrays'
signatures in one generated expression, writes five fields and calls ``cuLaunchKernel``.

Misuse, and what is detected
----------------------------
* **Freeing a bound buffer** cannot happen while the BoundVllmStep lives: it holds a
  reference to every bound array and to the lists given (drop it to release them).
* **Changing a bound buffer in place** (torch's ``resize_``, ``set_``, ``as_strided_``;
  CuPy's ``shape`` setter) or **replacing an item of a bound list** is seen by the next
  launch: its signature (pointer, device, shape, strides, dtype) or the list's items differ
  from the bound ones, so the whole request state is checked again (a bad change raises the
  error ``compute()`` raises, naming the array, and launches nothing; a good one is bound).
  Bound arrays without a cheap signature (``__cuda_array_interface__`` or DLPack objects,
  CuPy and torch mixed) and list/tuple subclasses are checked again at every launch.
* **Reallocating** (the engine replaces a buffer by a new object outside a bound list)
  needs a new ``bind``: the binding keeps launching on the old buffer, which it keeps alive.
* **Bad values** inside the buffers (a row index out of range, a block index past the row's
  width or ``num_blocks``, negative ids, ``query_start_loc`` decreasing) are recorded on the
  device as for ``compute()``: ``planner.check()``.

The planner's outputs and device state are shared: ``compute()`` and every binding of one
planner write the same buffers, so launch them on one stream (or order the streams). A
launch allocates no device memory and never synchronises, so it may be captured in a CUDA
graph (the driver copies the parameter block at the launch, also while capturing).
"""

from __future__ import annotations

import ctypes
import sys
from typing import TYPE_CHECKING

from kvaddr.engines.vllm_config import INT32, INT64, VllmStepOutputs, check_num_reqs_padded
from kvaddr.host import StreamResolver
from kvaddr.validation import array_kind, check_int, memo_guard, stream_handle

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["BoundVllmBatch", "BoundVllmStep"]

_NAMES = ("num_computed_tokens", "block_tables", "num_blocks")


def cupy_batch_check(max_num_reqs: int, device: int) -> Callable:
    """``check(idx_mapping, query_start_loc) -> (idx pointer, num_reqs, idx is int64, qsl pointer)``
    for CuPy arrays, read straight from their attributes, or None where any check of
    ``check_batch`` would fail (or the attributes are not CuPy's): then ``check_batch`` runs and
    raises its message. The checks are ``check_batch``'s: idx_mapping int32 or int64, 1-D, at most
    ``max_num_reqs`` entries, contiguous (more than one entry: a stride of one element), on
    ``device``; query_start_loc int32, shape ``(num_reqs + 1,)``, contiguous, on ``device``."""
    M, dev = max_num_reqs, device

    def check(idx, qsl):
        sh, dt = idx.shape, idx.dtype
        if len(sh) != 1 or (dt is not INT32 and dt is not INT64 and dt != INT32 and dt != INT64):
            return None
        n = sh[0]
        if n > M or (n > 1 and idx.strides[0] != dt.itemsize):
            return None
        qs, qt = qsl.shape, qsl.dtype
        if len(qs) != 1 or qs[0] != n + 1 or (qt is not INT32 and qt != INT32) or (n > 0 and qsl.strides[0] != 4):
            return None
        mi, mq = idx.data, qsl.data
        di, dq = getattr(mi, "device_id", None), getattr(mq, "device_id", None)
        if di is None:  # (a MemoryPointer without device_id: describe() reads x.device.id)
            di = idx.device.id
        if dq is None:
            dq = qsl.device.id
        if di != dev or dq != dev:
            return None
        return mi.ptr, n, dt == INT64, mq.ptr

    return check


def torch_batch_check(max_num_reqs: int, device: int, int32, int64, *, require_cuda: bool = True) -> Callable:
    """:func:`cupy_batch_check` for torch tensors (``int32``, ``int64``: torch's dtypes): CUDA
    tensors (``is_cuda``) on ``device``.

    A fresh slice of a persistent buffer (vLLM's ``idx_mapping[:num_reqs]``) is a new tensor
    every step, so nothing about it can be remembered; the check reads the fewest attributes
    that decide ``check_batch``'s checks, each a C-level read without a tuple or a
    ``torch.Size`` built: ``dtype`` (identity), ``dim()``, ``numel()`` (the length of a 1-D
    tensor), ``is_contiguous()`` (for 1-D: one entry, or a stride of one element), ``is_cuda``,
    ``get_device()``, ``data_ptr()``. A slice of another buffer or a strided view is judged by
    its own attributes like any tensor (a strided view is not contiguous, so it is refused).
    ``require_cuda=False`` drops the ``is_cuda`` reads (for timing the check on CPU tensors
    posing as a device's, ``device=-1``; never for launches)."""
    M, dev = max_num_reqs, device

    if require_cuda:

        def check(idx, qsl):
            dt = idx.dtype
            if (dt is not int32 and dt is not int64) or qsl.dtype is not int32 or idx.dim() != 1 or qsl.dim() != 1:
                return None
            n = idx.numel()
            if n > M or qsl.numel() != n + 1 or not (idx.is_contiguous() and qsl.is_contiguous()):
                return None
            if not (idx.is_cuda and qsl.is_cuda) or idx.get_device() != dev or qsl.get_device() != dev:
                return None
            return idx.data_ptr(), n, dt is int64, qsl.data_ptr()

    else:

        def check(idx, qsl):
            dt = idx.dtype
            if (dt is not int32 and dt is not int64) or qsl.dtype is not int32 or idx.dim() != 1 or qsl.dim() != 1:
                return None
            n = idx.numel()
            if n > M or qsl.numel() != n + 1 or not (idx.is_contiguous() and qsl.is_contiguous()):
                return None
            if idx.get_device() != dev or qsl.get_device() != dev:
                return None
            return idx.data_ptr(), n, dt is int64, qsl.data_ptr()

    return check


class BoundVllmStep:
    """The vLLM step bound to persistent request state: :meth:`launch` checks the batch and launches.

    Built by :meth:`kvaddr.engines.vllm.VllmStepPlanner.bind` (see there for the parameters);
    not meant to be built directly. With the batch buffers bound too (``bind(...,
    idx_mapping=, query_start_loc=)``) the binding is a :class:`BoundVllmBatch`, whose
    :meth:`~BoundVllmBatch.launch` takes two ints.

    Attributes
    ----------
    planner : VllmStepPlanner
        The planner whose kernel, outputs and device state this binding uses.
    params : kvaddr.engines.vllm.VllmStepParams
        This binding's own copy of the kernel's parameter block.
    """

    __slots__ = (
        "__weakref__",
        "_args",
        "_args_ptr",
        "_check_batch",
        "_check_state",
        "_debug",
        "_describe",
        "_device",
        "_fast",
        "_fast_checks",
        "_fptr",
        "_grid_y",
        "_infos",
        "_lanes",
        "_launch",
        "_max_num_reqs",
        "_outputs",
        "_plan",
        "_plans",
        "_resolve",
        "_same",
        "_state",
        "_stream",
        "_threads",
        "_written",
        "params",
        "planner",
    )

    def __init__(
        self,
        *,
        planner,
        params,
        threads: int,
        max_num_reqs: int,
        device: int,
        outputs: VllmStepOutputs,
        check_state: Callable,
        check_batch: Callable,
        plan: Callable,
        num_computed_tokens,
        block_tables,
        num_blocks,
        stream=None,
        describe_bound: Callable | None = None,
        debug: bool = False,
    ):
        self.planner = planner
        self.params = params  # this binding's own copy of the planner's parameter block
        self._launch, self._fptr = None, 0  # the driver call and the step's kernel: _bind_state sets them
        self._grid_y = getattr(planner, "_grid_y", 1)  # 2: the planner's DSA blocks run as the grid's second row
        self._threads = int(threads)
        self._max_num_reqs, self._device = max_num_reqs, device
        self._outputs = outputs
        # (nct, tables, num_blocks) -> (ptr, [(ptr, stride)], ([ptr], [source ptr], (launch_kernel, function)))
        self._check_state = check_state
        self._check_batch = check_batch  # (idx_mapping, query_start_loc, M, device) -> (ArrayInfo, ArrayInfo)
        self._plan = plan  # (num_reqs_padded, num_reqs) -> (blocks, lanes per pair)
        self._describe = describe_bound  # {name: signature} of the bound arrays (check_bound)
        self._debug = bool(debug)
        self._lanes = params.pair_lanes  # the lanes in this binding's parameter block
        self._plans: dict = {}  # num_reqs -> (blocks, lanes)
        self._stream = None if stream is None else stream_handle(stream)
        self._resolve = StreamResolver()
        # kernelParams: one pointer, to this binding's struct (passed by value)
        self._args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self._args_ptr = ctypes.addressof(self._args)
        # (idx_mapping class, query_start_loc class, their fast batch check or None): the last classes seen
        self._fast: tuple = (None, None, None)
        self._fast_checks: dict = {}  # (idx_mapping class, query_start_loc class) -> fast batch check or None
        self._written = None  # the batch fields last written into the parameter block
        self._state = (num_computed_tokens, block_tables, num_blocks)
        self._same = None
        self._infos = None
        self._bind_state()

    def _fast_check(self, idx_mapping, query_start_loc) -> tuple:
        """``(idx class, qsl class, the fast batch check for them or None)``, remembered as the last."""
        key = (idx_mapping.__class__, query_start_loc.__class__)
        check = self._fast_checks.get(key, False)
        if check is False:
            check = self._fast_checks[key] = self._make_fast_check(idx_mapping, query_start_loc)
        self._fast = (*key, check)
        return self._fast

    def _make_fast_check(self, idx_mapping, query_start_loc):
        """The fast batch check for these classes (both CuPy or both torch), or None."""
        kind = array_kind(idx_mapping)
        check = None
        if kind and array_kind(query_start_loc) == kind:
            if kind == "cupy":
                check = cupy_batch_check(self._max_num_reqs, self._device)
            else:
                torch = sys.modules.get("torch")  # (loaded: x is one of its tensors)
                if torch is not None:
                    check = torch_batch_check(self._max_num_reqs, self._device, torch.int32, torch.int64)
        return check

    def _bind_state(self) -> None:
        """Check the bound request state (as compute() does) and write it into the parameter block;
        then remember each array's signature (and a list's items) in one guard."""
        self._same = None  # until every check passed: a failed check leaves the state unbound
        P = self.params
        nct, tables, (nbs, sources, launch) = self._check_state(*self._state)
        P.num_computed_tokens = nct  # [rows >= M], int32
        for g, (ptr, stride) in enumerate(tables):
            P.block_table[g] = ptr  # [rows >= M, W_g], int32
            P.table_stride[g] = stride  # int64, elements
        for g, ptr in enumerate(nbs):
            # [rows >= M], int32: the given device memory, or (staged: num_blocks in pinned host
            # memory) the planner's device copy of num_blocks_src[g], filled by the launch's first kernel
            P.num_blocks[g], P.num_blocks_src[g] = ptr, sources[g]
        self._launch, self._fptr = launch[0], int(launch[1])  # the step that reads those fields
        self._infos = self._describe_all()  # check_bound's: every bound array's signature now
        # (None: no cheap signature, or a list/tuple subclass: checked again at every launch)
        self._same = memo_guard(self._state)

    def _describe_all(self) -> dict:
        """``{argument name: (pointer, shape, strides, dtype, device), or the items of a bound list}``."""
        return self._describe(*self._state)

    @property
    def bound(self) -> dict:
        """The bound request state by argument name (the objects given to ``bind``)."""
        return dict(zip(_NAMES, self._state))

    @property
    def debug(self) -> bool:
        """Whether every launch runs :meth:`check_bound` first (``bind(..., debug=True)``)."""
        return self._debug

    def check_bound(self) -> None:
        """Describe every bound array again; raise ValueError naming one that changed since ``bind``.

        Detects an in-place change of a bound array (torch's ``resize_``, ``set_``,
        ``as_strided_``; CuPy's ``shape`` setter) and an item of a bound list replaced: the
        array's pointer, shape, strides, dtype or device, or the list's items, differ from what
        was bound. Costs one ``describe`` per array; ``bind(..., debug=True)`` runs it before
        every launch. Nothing is re-bound: bind again after a deliberate change.
        """
        now = self._describe_all()
        for name, was in self._infos.items():
            got = now.get(name)
            if got != was:
                raise ValueError(f"{name} changed since bind (was {_sig_text(was)}, now {_sig_text(got)}): bind again")

    def launch(
        self, idx_mapping, query_start_loc, num_reqs_padded: int | None = None, *, stream=None
    ) -> VllmStepOutputs:
        """One step's inputs for vLLM in one kernel launch, over the bound request state.

        Parameters
        ----------
        idx_mapping : int32 or int64 [num_reqs], device array
            Batch index b -> request-state row r; -1 marks a dummy (padding) request.
        query_start_loc : int32 [num_reqs + 1], device array
            Request b's tokens are ``[qsl[b], qsl[b+1])``.
        num_reqs_padded : int, optional
            The batch's graph size, ``num_reqs <= . <= max_num_reqs`` (default num_reqs).
        stream : CuPy stream, torch stream, raw handle or ``__cuda_stream__`` object, optional
            Where to launch; the stream given to ``bind`` by default, else CuPy's current stream.
            A torch stream object new at every call (``torch.cuda.current_stream()``) costs one
            attribute read.

        Returns
        -------
        VllmStepOutputs
            The planner's persistent output buffers (``out=`` tensors where given), as
            :meth:`VllmStepPlanner.compute` returns them.

        Notes
        -----
        ``idx_mapping`` and ``query_start_loc`` are checked in full at every launch (the checks
        and messages of ``compute()``), CuPy arrays and torch tensors read straight from their
        attributes (a fresh slice of a buffer every step costs the same as the same object);
        the bound arrays are checked again only when one's signature or a bound list's items
        changed (see the module's docstring), and with ``debug=True`` every launch runs
        :meth:`check_bound` (which raises instead).
        """
        # Stream: a raw handle as is; the bound default; else as every planner resolves one.
        if stream.__class__ is not int:
            stream = self._stream if stream is None and self._stream is not None else self._resolve(stream)
        if self._debug:
            self.check_bound()
        # The bound request state: the same signatures (and list items) as when it was checked.
        same = self._same
        if same is None or not same(*self._state):
            self._bind_state()
        return self._launch_slices(idx_mapping, query_start_loc, num_reqs_padded, stream)

    def _launch_slices(self, idx_mapping, query_start_loc, num_reqs_padded, stream: int) -> VllmStepOutputs:
        """The batch checked and launched, the bound state taken as it is (``stream``: a raw handle).
        :meth:`launch`'s body after the state's guard; ``VllmStepPlanner.compute`` calls it
        after its own test of the state."""
        # The batch: every check, every launch. CuPy arrays and torch tensors are read straight
        # (cupy_batch_check / torch_batch_check: check_batch's checks, inline); anything else, or a
        # failed check, goes through check_batch (describe + check_vector), which raises the message.
        M = self._max_num_reqs
        fast = self._fast
        if idx_mapping.__class__ is not fast[0] or query_start_loc.__class__ is not fast[1]:
            fast = self._fast_check(idx_mapping, query_start_loc)
        fast = fast[2]
        batch = None if fast is None else fast(idx_mapping, query_start_loc)
        if batch is None:
            idx, qsl = self._check_batch(idx_mapping, query_start_loc, M, self._device)
            batch = (idx.ptr, idx.shape[0], idx.dtype == INT64, qsl.ptr)
        n = batch[1]
        if num_reqs_padded is None:
            padded = n
        elif num_reqs_padded.__class__ is int and n <= num_reqs_padded <= M:
            padded = num_reqs_padded
        else:
            padded = check_num_reqs_padded(num_reqs_padded, n, M)
        plan = self._plans.get(n)
        if plan is None:
            plan = self._plans[n] = self._plan(padded, n)
        written = (batch, padded)
        if written != self._written:  # (vLLM's slices of persistent buffers keep their pointers)
            P = self.params
            P.idx_mapping = batch[0]  # [num_reqs], int32 or int64
            P.num_reqs = n
            P.idx_is_64 = batch[2]
            P.query_start_loc = batch[3]  # [num_reqs + 1], int32
            P.num_reqs_padded = padded
            if plan[1] and plan[1] != self._lanes:  # the gather's lanes per pair, by num_reqs
                P.pair_lanes = self._lanes = plan[1]
            self._written = written
        self._launch(self._fptr, plan[0], self._grid_y, 1, self._threads, 1, 1, 0, stream, self._args_ptr, 0)
        return self._outputs


def _sig_text(sig) -> str:
    if sig is None:
        return "missing"
    if isinstance(sig, tuple) and len(sig) == 5:
        ptr, shape, strides, dtype, dev = sig
        return f"pointer {ptr:#x} shape {shape} strides {strides} {dtype} device {dev}"
    return repr(sig)


class BoundVllmBatch(BoundVllmStep):
    """The vLLM step bound to the request state AND the batch buffers: :meth:`launch` takes two ints.

    vLLM's ``idx_mapping`` and ``query_start_loc`` are slices ``[:num_reqs]`` and
    ``[:num_reqs + 1]`` of persistent buffers. Bound whole (``VllmStepPlanner.bind(...,
    idx_mapping=buffer, query_start_loc=buffer)``), they are checked once, like the request
    state, and their pointers written into this binding's parameter block; a step is then
    ``launch(num_reqs, num_reqs_padded, stream)``: the two ints are checked (ranges), the
    struct's two counts written, and ``cuLaunchKernel`` called. Nothing else is described,
    converted or compared per launch: an in-place change of a bound array (a ``resize_``, a
    list item replaced) is not seen, except by :meth:`check_bound` and with ``debug=True``
    (then every launch runs it and raises ValueError naming the array). Built by
    :meth:`~kvaddr.engines.vllm.VllmStepPlanner.bind`; not meant to be built directly.

    Attributes
    ----------
    max_num_reqs : int
        The largest ``num_reqs`` :meth:`launch` accepts: the bound ``idx_mapping``'s length,
        ``len(query_start_loc) - 1`` and the planner's ``max_num_reqs``, whichever is least.
    """

    __slots__ = ("_batch", "_n", "_padded", "max_num_reqs")

    def __init__(self, *, idx_mapping, query_start_loc, check_batch_buffers: Callable, **kw):
        self._batch = (idx_mapping, query_start_loc)
        super().__init__(**kw)
        ip, n_idx, is64, qp, n_qsl = check_batch_buffers(idx_mapping, query_start_loc)
        P = self.params
        P.idx_mapping = ip  # [rows], int32 or int64: the batch is its first num_reqs entries
        P.idx_is_64 = is64
        P.query_start_loc = qp  # [rows + 1], int32: the batch's are its first num_reqs + 1 entries
        self.max_num_reqs = min(n_idx, n_qsl - 1, self._max_num_reqs)
        self._n = self._padded = None  # the counts last written (None: not yet)

    def _describe_all(self) -> dict:
        return self._describe(*self._state, *self._batch)

    @property
    def bound(self) -> dict:
        """The bound request state and batch buffers by argument name (the objects given to ``bind``)."""
        return {**dict(zip(_NAMES, self._state)), "idx_mapping": self._batch[0], "query_start_loc": self._batch[1]}

    def launch(self, num_reqs: int, num_reqs_padded: int | None = None, stream=None) -> VllmStepOutputs:
        """One step's inputs for vLLM in one kernel launch: the bound buffers' first ``num_reqs``
        batch entries over the bound request state.

        Parameters
        ----------
        num_reqs : int
            Requests this step, ``0 <= num_reqs <=`` :attr:`max_num_reqs`: the batch is
            ``idx_mapping[:num_reqs]`` and ``query_start_loc[:num_reqs + 1]`` of the bound buffers
            (their contents as the stream finds them when the kernel runs).
        num_reqs_padded : int, optional
            The batch's graph size, ``num_reqs <= . <= planner.config.max_num_reqs`` (default
            num_reqs): gathered rows up to it (and those an earlier step filled) are zeroed.
        stream : CuPy stream, torch stream, raw handle or ``__cuda_stream__`` object, optional
            Where to launch; the stream given to ``bind`` by default, else CuPy's current stream.

        Returns
        -------
        VllmStepOutputs
            The planner's persistent output buffers, as :meth:`VllmStepPlanner.compute` returns them.

        Raises
        ------
        TypeError, ValueError
            ``num_reqs`` or ``num_reqs_padded`` is not an int in its range (the message names it);
            with ``debug=True``, a bound array changed since ``bind`` (:meth:`check_bound`).
        """
        plan = self._plans.get(num_reqs) if num_reqs.__class__ is int else None
        if plan is None:  # a count not launched before (or not an int): checked once
            n = check_int("num_reqs", num_reqs, lo=0, hi=self.max_num_reqs)
            plan = self._plans[n] = self._plan(n, n)
            num_reqs = n
        if num_reqs_padded is None:
            num_reqs_padded = num_reqs
        elif num_reqs_padded.__class__ is not int or not num_reqs <= num_reqs_padded <= self._max_num_reqs:
            num_reqs_padded = check_num_reqs_padded(num_reqs_padded, num_reqs, self._max_num_reqs)
        if stream.__class__ is not int:
            stream = self._stream if stream is None and self._stream is not None else self._resolve(stream)
        if self._debug:
            self.check_bound()
        if num_reqs != self._n:
            P = self.params
            P.num_reqs = self._n = num_reqs
            if plan[1] != self._lanes:  # the gather's lanes per pair, by num_reqs
                P.pair_lanes = self._lanes = plan[1]
        if num_reqs_padded != self._padded:
            self.params.num_reqs_padded = self._padded = num_reqs_padded
        self._launch(self._fptr, plan[0], self._grid_y, 1, self._threads, 1, 1, 0, stream, self._args_ptr, 0)
        return self._outputs
