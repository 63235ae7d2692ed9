"""BoundStep: the fused step bound once to an engine's persistent buffers, then only launched.

An engine keeps its step inputs in persistent device buffers sized for its largest batch
and rewrites their contents every step. :meth:`kvaddr.planner.StepPlanner.bind` checks
those buffers once (dtype, rank, device, contiguity, rows, exactly as
:meth:`~kvaddr.planner.StepPlanner.compute` does), writes their pointers, strides and
widths into a private copy of the planner's kernel parameter struct, and returns a
:class:`BoundStep`. :meth:`BoundStep.launch` then writes one int (bsz) and calls
``cuLaunchKernel`` with a prebuilt parameter array: no argument is described, converted
or checked again.

Misuse, and what is detected
----------------------------
* **Freeing a bound buffer** cannot happen while the BoundStep lives: it holds a
  reference to every bound array (drop the BoundStep to release them).
* **Changing a bound buffer in place** (a ``resize_``, ``set_`` or ``as_strided_`` on a
  torch tensor; CuPy arrays cannot be changed in place) is not seen by :meth:`launch`.
  :meth:`BoundStep.check_bound` re-describes every bound array and raises
  ``ValueError`` naming the one whose pointer, shape, strides, dtype or device changed;
  ``bind(..., debug=True)`` runs it before every launch.
* **Reallocating** (the engine replaces a buffer by a new one) needs a new ``bind``:
  the BoundStep keeps launching on the old buffer, which it keeps alive.
* **bsz** must be an int in ``[0, bound rows]`` (the bound length arrays' length, at most
  the planner's ``max_requests``): :meth:`launch` checks it with one comparison (a
  non-int is refused by the same comparison or by ctypes).
* **Bad values** inside the buffers (negative lengths, bad block ids, too many tokens)
  are recorded on the device as for ``compute()``: ``planner.check()``.

The planner's outputs are shared: ``compute()`` and every BoundStep of one planner write
the same buffers (and use the same device state), so launch them on one stream (or
order the streams).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from kvaddr.validation import (
    INT32_MAX,
    check_info,
    describe,
    normalize_tables,
    stream_handle,
)


class BoundStep:
    """The fused step bound to persistent inputs: :meth:`launch` only launches.

    Built by :meth:`kvaddr.planner.StepPlanner.bind` (see there for the parameters);
    not meant to be built directly.

    Attributes
    ----------
    max_bsz : int
        The bound length arrays' length: the largest bsz :meth:`launch` accepts.
    params : kvaddr.kernel_loader.StepParams
        This binding's own copy of the kernel's parameter struct.
    """

    __slots__ = (
        "__weakref__",
        "_bsz_default",
        "_debug",
        "_grid_y",
        "_infos",
        "_launch_kernel",
        "_names",
        "_outputs",
        "_params_array",
        "_params_ptr",
        "_plan",
        "_plans",
        "_stream",
        "max_bsz",
        "params",
    )

    def __init__(
        self,
        *,
        params,
        plan: Callable[[int], tuple[int, int, int]],
        device: int,
        max_requests: int,
        num_caches: int,
        seq_lens_decoder,
        seq_lens_this_time,
        block_tables=None,
        seq_lens_encoder=None,
        stream=None,
        outputs: Callable[[int], Any] | None = None,
        debug: bool = False,
        launch_kernel: Callable | None = None,
        hold: bool = True,
        grid_y: int = 1,
    ):
        dec = check_info("seq_lens_decoder", describe("seq_lens_decoder", seq_lens_decoder), ndim=1, device=device)
        rows = dec.shape[0]
        q = check_info("seq_lens_this_time", describe("seq_lens_this_time", seq_lens_this_time), ndim=1, device=device)
        if q.shape[0] != rows:
            raise ValueError(
                f"seq_lens_this_time must have shape (bsz,) = ({rows},) like seq_lens_decoder, got {q.shape}"
            )
        names, infos = ["seq_lens_decoder", "seq_lens_this_time"], [dec, q]
        if seq_lens_encoder is not None:
            enc = check_info("seq_lens_encoder", describe("seq_lens_encoder", seq_lens_encoder), ndim=1, device=device)
            if enc.shape[0] != rows:
                raise ValueError(
                    f"seq_lens_encoder must have shape (bsz,) = ({rows},) like seq_lens_decoder, got {enc.shape}"
                )
            names.append("seq_lens_encoder")
            infos.append(enc)
        if rows > max_requests:
            raise ValueError(f"seq_lens_decoder must have at most max_requests = {max_requests} entries, got {rows}")
        P = params
        if num_caches:
            if block_tables is None:
                raise TypeError("block_tables must be an int32 array or a sequence of them, got None")
            tables = normalize_tables(block_tables, num_caches)
            many = num_caches > 1 and tables[0] is not tables[1]
            info, last = None, None
            for g, t in enumerate(tables):
                name = f"block_tables[{g}]" if many else "block_tables"
                if t is not last:
                    info = check_info(name, describe("block_tables", t), ndim=2, min_rows=rows, device=device)
                    if info.shape[1] > INT32_MAX:
                        raise ValueError("block_tables must have fewer than 2**31 columns")
                    names.append(name)
                    infos.append(info)
                    last = t
                P.block_tables[g] = info.ptr  # [rows >= bsz, max_blocks], int32
                P.table_stride[g] = info.strides[0]  # int64, elements
                P.max_blocks[g] = info.shape[1]  # int32
        P.seq_lens_decoder = dec.ptr  # [rows], int32
        P.seq_lens_this_time = q.ptr  # [rows], int32
        P.bsz = rows  # int32, rewritten by launch()
        self.params = P
        self.max_bsz = rows
        self._bsz_default = rows
        if not hold:  # the caller keeps the arrays alive (and forgets this binding when one dies)
            infos = [info._replace(obj=None) for info in infos]
        self._names, self._infos = tuple(names), tuple(infos)  # the infos keep the arrays alive
        self._stream = None if stream is None else stream_handle(stream)
        self._outputs = outputs
        self._debug = bool(debug)
        # bsz -> (function pointer, blocks, threads): the dispatch table's launch (kvaddr.dispatch)
        self._plan = plan
        # kernelParams: one pointer, to the struct (passed by value; the driver copies its
        # bytes at launch, so rewriting bsz right after a launch, or while a CUDA graph is
        # being captured, is safe).
        self._params_array = (ctypes.c_void_p * 1)(ctypes.addressof(P))
        self._params_ptr = ctypes.addressof(self._params_array)
        if launch_kernel is None:
            from cupy.cuda import driver

            launch_kernel = driver.launchKernel
        self._launch_kernel = launch_kernel
        self._grid_y = grid_y  # 2: the planner's DSA blocks run as the grid's second row
        self._plans: dict = {}  # bsz -> (fptr, blocks, threads), filled by launch()

    def grid(self, bsz: int) -> int:
        """Blocks of the launch for ``bsz`` requests (as :meth:`StepPlanner.kernel_for`)."""
        return self._plan(bsz)[1]

    def launch_args(self, bsz: int | None = None) -> tuple:
        """What :meth:`launch` hands the driver for ``bsz`` requests, for a caller that launches on a
        hot path of its own (the torch ops keep it per argument set).

        Parameters
        ----------
        bsz : int, optional
            Requests, ``0 <= bsz <= max_bsz``; the bound length by default. Written into the
            bound parameters here: a later :meth:`launch` with another ``bsz`` rewrites it.

        Returns
        -------
        tuple
            ``(launch_kernel, function, blocks, grid_y, threads, kernel_params)``, to be called
            as ``launch_kernel(function, blocks, grid_y, 1, threads, 1, 1, 0, stream,
            kernel_params, 0)`` with a raw stream handle; that call checks nothing.
        """
        if bsz is None:
            bsz = self._bsz_default
        if not 0 <= bsz <= self.max_bsz:
            raise ValueError(f"bsz must be an int in [0, {self.max_bsz}] (the bound rows), got {bsz!r}")
        fptr, blocks, threads = self._plan(bsz)
        self.params.bsz = bsz
        return (self._launch_kernel, fptr, blocks, self._grid_y, threads, self._params_ptr)

    def launch(self, bsz: int | None = None, stream=None):
        """Launch the step over the first ``bsz`` requests of the bound buffers.

        Parameters
        ----------
        bsz : int, optional
            Requests this step, ``0 <= bsz <= max_bsz``; the bound length by default.
            The kernel reads ``bsz`` entries of the length arrays and ``bsz`` rows of
            the tables. Checked with one comparison, nothing else.
        stream : stream or int handle, optional
            Where to launch; the stream given to ``bind`` by default, else CuPy's
            current stream (looked up at each launch).

        Returns
        -------
        StepOutputs or None
            The planner's outputs for ``bsz`` (views, cached per bsz) when bound by a
            planner, else None.
        """
        if bsz is None:
            bsz = self._bsz_default
        plan = self._plans.get(bsz)  # (kernel, blocks, threads) of a bsz launched before
        if plan is None:
            if not 0 <= bsz <= self.max_bsz:
                raise ValueError(f"bsz must be an int in [0, {self.max_bsz}] (the bound rows), got {bsz!r}")
            plan = self._plans[bsz] = self._plan(bsz)
        if self._debug:
            self.check_bound()
        if stream is None:
            stream = self._stream
            if stream is None:
                stream = stream_handle(None)
        elif stream.__class__ is not int:
            stream = stream_handle(stream)
        self.params.bsz = bsz
        self._launch_kernel(plan[0], plan[1], self._grid_y, 1, plan[2], 1, 1, 0, stream, self._params_ptr, 0)
        out = self._outputs
        return None if out is None else out(bsz)

    def check_bound(self) -> None:
        """Re-describe every bound array; raise ValueError if one changed since ``bind``.

        Detects an in-place change of a bound torch tensor (``resize_``, ``set_``,
        ``as_strided_``, in-place transposes): its pointer, shape, strides, dtype or
        device differ from what was bound. Costs one ``describe`` per array.
        """
        for name, old in zip(self._names, self._infos):
            if old.obj is None:
                raise ValueError("check_bound needs a BoundStep that holds its arrays (built with hold=True)")
            new = describe(name, old.obj)
            if (new.ptr, new.shape, new.strides, new.dtype, new.device) != (
                old.ptr,
                old.shape,
                old.strides,
                old.dtype,
                old.device,
            ):
                raise ValueError(
                    f"{name} changed since bind (pointer {old.ptr:#x} shape {old.shape} strides {old.strides} "
                    f"{old.dtype} -> pointer {new.ptr:#x} shape {new.shape} strides {new.strides} {new.dtype}): "
                    f"bind again"
                )

    @property
    def bound(self) -> dict:
        """The bound arrays by argument name (the objects given to ``bind``)."""
        return {name: info.obj for name, info in zip(self._names, self._infos)}
