"""Host staging: the one copy made on the training thread.

One reusable uint8 buffer laid out like the shard's data section, so the writer thread writes
it to storage with no second copy; only tensors copied from a GPU start at aligned offsets
(``settings.STAGING_ALIGN``: the copy engine's destinations are aligned), and the writer skips
that padding (``shard_layout.file_pieces``). It is mapped once with exactly the
layout's size and reused while it is large enough. For accelerator state it is page-locked
by us, in chunks, and unlocked on ``release`` or when it must grow (``ckptctl.state.pinned``
says why torch's pinned allocator is not used); if locking fails the save goes on through
ordinary memory, with one warning.

The first snapshot pays for faulting the buffer's pages in (and for pinning them), unless
``prepare`` did that earlier on a background thread: the training job calls
``Checkpointer.prepare`` (or ``load_latest`` does) long before its first save.

Device-to-host copies, and why they are grouped by device: a copy's ``copy_`` is queued on the
*current stream of the source tensor's device*, and ``torch.cuda.stream(s)`` makes ``s``
current only on ``s``'s own device. So each source device gets a side stream of its own
(created under that device), which first waits for that device's current (compute) stream, so
every kernel queued before ``save()`` lands in the snapshot; the copies are issued under that
device with its stream current, and every stream used is synchronized before ``snapshot``
returns, so the training loop may change its tensors as soon as it does.

Ordinary pages by default. Huge pages (``CKPTCTL_HUGEPAGES=1``: the mapping is advised
MADV_HUGEPAGE) fault in faster when the kernel has free ones, and several times slower when it
must compact memory to find them (figures: ``docs/decisions.md``, "Staging on ordinary pages").
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import AbstractSet, Callable, Mapping, Sequence

import torch

from ckptctl.save.overlap import CopyFence
from ckptctl.save.shard_layout import ShardLayout, Slot, view
from ckptctl.state.buffers import copy_host
from ckptctl.state.pinned import CudaRegistrar, HostRegion, Registrar, host_wait_event, split_at
from ckptctl.state.placement import SavedTensor

log = logging.getLogger("ckptctl")

# Makes the registrar that page-locks host memory for copies from device ``index``.
RegistrarFor = Callable[[int], Registrar]

HOST = -1  # the group key of slots whose source is already in host memory


class StagingBuffer:
    """The reusable host buffer of one rank's saves.

    ``registrar_for`` injects how memory is page-locked (default: CUDA's ``cudaHostRegister``
    when CUDA is available); with it given, pinning is attempted whenever the layout holds
    accelerator state, which lets the whole ownership sequence run without a GPU.
    ``register_chunk``: bytes per registration (default ``pinned.REGISTER_CHUNK``, read when
    the buffer is mapped)."""

    def __init__(self, *, registrar_for: RegistrarFor | None = None, register_chunk: int | None = None) -> None:
        self._registrar_for = registrar_for
        self._chunk = register_chunk
        self._region: HostRegion | None = None
        self._pin_asked = False  # whether _region was made asking for pinning (a failure is not retried)
        self._streams: dict[int, "torch.cuda.Stream"] = {}
        self._coming: "tuple[Future[HostRegion], bool] | None" = None  # (region, pin asked) from prepare
        self.fence: CopyFence | None = None  # copies the last snapshot left in flight (overlap)

    # --- the buffer ----------------------------------------------------------------------

    def prepare(self, layout: ShardLayout, tensors: Mapping[str, SavedTensor] | None = None) -> bool:
        """Map the buffer for ``layout``, fault its pages in and pin them on a background
        thread, so that the next snapshot only copies. ``tensors`` (optional) tell which GPU
        the state lives on. Returns False when there is nothing to do: a large enough buffer
        exists or is already being prepared."""
        pin = self._wants_pinned(layout)
        if self._coming is not None or self._fits(layout, pin):
            return False
        self.settle()
        self._drop_region()  # the old one is too small: unmap it before mapping its replacement
        ready: "Future[HostRegion]" = Future()
        # The current CUDA device is per thread: choose it here, on the caller's thread.
        registrar = self._registrar(tensors) if pin else None

        def work() -> None:
            try:
                ready.set_result(HostRegion(layout.buffer_nbytes, registrar=registrar, fault_in=True, chunk=self._chunk))
            except BaseException as e:  # noqa: BLE001 - any failure must reach reserve(), which waits on it
                ready.set_exception(e)
                if not isinstance(e, Exception):
                    raise

        threading.Thread(target=work, name="ckptctl-prefault", daemon=True).start()
        self._coming = (ready, pin)
        return True

    def reserve(self, layout: ShardLayout, tensors: Mapping[str, SavedTensor] | None = None) -> torch.Tensor:
        """A buffer of at least ``layout.buffer_nbytes``, reused while it is large enough: only the
        first snapshot faults pages in and pins them (unless prepared); later ones copy into
        resident memory."""
        self._take_prepared()
        pin = self._wants_pinned(layout)
        if not self._fits(layout, pin):
            self.settle()  # no copy may still be landing in the buffer about to be unmapped
            self._drop_region()  # unlock and unmap the old one before mapping its replacement
            registrar = self._registrar(tensors) if pin else None
            self._region, self._pin_asked = HostRegion(layout.buffer_nbytes, registrar=registrar, chunk=self._chunk), pin
        assert self._region is not None
        return self._region.tensor

    def lend(self, nbytes: int, pin_device: int | None, map_new: bool = False) -> HostRegion | None:
        """The buffer, for a load to read into (``load.staged.HostLender``; the caller keeps
        saves off it meanwhile): at least ``nbytes``, page-locked under CUDA device
        ``pin_device`` when that is given. The buffer held (or being prepared) when it is large
        enough; else, with ``map_new``, a new one, which then stays as the staging buffer (the
        memory the next save needs anyway, its pages faulted in by the load's reads); else
        None. None too, with a warning, when the memory cannot be mapped."""
        self.settle()
        self._take_prepared()
        pin = pin_device is not None and (self._registrar_for is not None or torch.cuda.is_available())
        r = self._region
        if r is None or r.nbytes < nbytes or (pin and not self._pin_asked):
            if not map_new:
                return None
            self._drop_region()
            registrar = (self._registrar_for or CudaRegistrar)(pin_device) if pin and pin_device is not None else None
            try:
                self._region, self._pin_asked = HostRegion(nbytes, registrar=registrar, chunk=self._chunk), pin
            except OSError as e:  # mmap: ENOMEM, an overcommit limit
                log.warning("load: cannot map %d bytes of host memory to read into (%s); reading twice instead", nbytes, e)
                return None
        return self._region

    def _take_prepared(self) -> None:
        """Wait for the buffer ``prepare`` is making, and hold it (rather than make a second)."""
        if self._coming is None:
            return
        (ready, pin), self._coming = self._coming, None
        try:
            self._region, self._pin_asked = ready.result(), pin
        except Exception as e:  # reported, then the buffer is mapped by the caller: the save goes on
            log.warning("could not prepare the staging buffer in advance (%s); allocating it now", e)

    @property
    def pinned(self) -> bool:
        """Whether the buffer held is page-locked (staging for GPU state)."""
        return self._region is not None and self._region.pinned

    @property
    def pinned_bytes(self) -> int:
        """Bytes this buffer holds page-locked now: the layout's size, or 0."""
        return self._region.pinned_bytes if self._region is not None else 0

    @property
    def nbytes(self) -> int:
        """Size of the buffer held (0 when none)."""
        return self._region.nbytes if self._region is not None else 0

    @property
    def ready(self) -> bool:
        """Whether a buffer is held and no preparation is still under way."""
        if self._coming is not None:
            return self._coming[0].done()
        return self._region is not None

    @property
    def held(self) -> bool:
        """Whether a buffer is held or being prepared."""
        return self._region is not None or self._coming is not None

    def _wants_pinned(self, layout: ShardLayout) -> bool:
        return layout.needs_pinned and (self._registrar_for is not None or torch.cuda.is_available())

    def _fits(self, layout: ShardLayout, pin: bool) -> bool:
        r = self._region
        return r is not None and r.nbytes >= layout.buffer_nbytes and self._pin_asked == pin

    def _registrar(self, tensors: Mapping[str, SavedTensor] | None) -> Registrar:
        device = pin_device(
            [t.data.device for t in tensors.values()] if tensors else [],
            local_rank=os.environ.get("LOCAL_RANK"),
            device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            current=torch.cuda.current_device() if torch.cuda.is_available() else 0,
        )
        return (self._registrar_for or CudaRegistrar)(device)

    def _drop_region(self) -> None:
        region, self._region = self._region, None
        if region is not None:
            region.release()

    # --- the copies ----------------------------------------------------------------------

    def snapshot(
        self, layout: ShardLayout, tensors: Mapping[str, SavedTensor], *, deferred: AbstractSet[str] = frozenset()
    ) -> torch.Tensor:
        """Copy every tensor into the buffer; returns when the copies are complete, so the
        training loop may modify its tensors as soon as this returns.

        ``deferred`` (the opt-in overlap, see ``save.overlap.overlap_plan``): names of GPU tensors whose
        copies may still be in flight when this returns; ``self.fence`` then holds the events
        that mark their end (``save.overlap.CopyFence``). Every other copy is complete on return."""
        self.settle()
        buf = self.reserve(layout, tensors)
        if not layout.needs_pinned:
            _copy_to_host(buf, layout.slots, tensors)
            return buf
        groups = group_by_device(layout.slots, {n: t.data.device for n, t in tensors.items()})
        boundaries = self._region.boundaries if self._region is not None else ()
        used: list["torch.cuda.Stream"] = []
        now: list["torch.cuda.Event"] = []  # per device: its synchronous copies are done
        later: dict[int, "torch.cuda.Event"] = {}  # per device: its deferred copies are done too
        ok = False
        try:
            for index, slots in groups.items():
                if index == HOST:
                    continue
                stream = self._stream_on(index)
                used.append(stream)
                with torch.cuda.device(index):
                    stream.wait_stream(torch.cuda.current_stream(index))
                    with torch.cuda.stream(stream):
                        # Synchronous copies first: the host waits only for them.
                        for slot in (s for s in slots if s.name not in deferred):
                            _copy_device_slot(buf, slot, tensors[slot.name].data, boundaries)
                        late = [s for s in slots if s.name in deferred]
                        if late:
                            now.append(_recorded(stream))
                            for slot in late:
                                src = tensors[slot.name].data
                                # The training loop may free it before the copy has read it:
                                # the allocator must not hand its memory out before then.
                                src.record_stream(stream)
                                _copy_device_slot(buf, slot, src, boundaries)
                            later[index] = _recorded(stream)
            # Host-resident tensors are copied while the device copies are in flight.
            _copy_to_host(buf, groups.get(HOST, ()), tensors)
            ok = True
        finally:
            if not ok or not later:  # a failure leaves no copy landing in buf behind it
                for stream in used:
                    stream.synchronize()
            else:
                for index, stream in zip((i for i in groups if i != HOST), used):
                    if index not in later:
                        stream.synchronize()
                for event in now:
                    event.synchronize()
        self.fence = CopyFence(later) if ok and later else None
        return buf

    def settle(self) -> None:
        """Wait for copies a previous snapshot left in flight (no-op without the overlap)."""
        fence, self.fence = self.fence, None
        if fence is not None:
            fence.synchronize()

    def _stream_on(self, index: int) -> "torch.cuda.Stream":
        stream = self._streams.get(index)
        if stream is None:
            # A stream belongs to the device current when it is made: make it under ``index``.
            with torch.cuda.device(index):
                stream = self._streams[index] = torch.cuda.Stream()
        return stream

    def release(self) -> None:
        """Unlock and unmap the buffer (the caller has drained every write that reads it). A
        preparation still running releases its buffer as soon as it is done."""
        self.settle()
        self._drop_region()
        self._streams = {}
        if self._coming is not None:
            (ready, _), self._coming = self._coming, None
            ready.add_done_callback(_release_prepared)


def _recorded(stream: "torch.cuda.Stream") -> "torch.cuda.Event":
    """An event recorded on ``stream`` that the host waits on without spinning a core: the
    training thread for the synchronous copies, the writer thread for the deferred ones (for
    the whole overlap window); ``stream.record_event()`` would make a spinning one."""
    event = host_wait_event()
    event.record(stream)
    return event


def _release_prepared(ready: "Future[HostRegion]") -> None:
    if ready.exception() is None:
        ready.result().release()


def _copy_to_host(buf: torch.Tensor, slots: "Sequence[Slot]", tensors: Mapping[str, SavedTensor]) -> None:
    """Copy host-resident (or other accelerators') tensors into their slots: dense host tensors
    as memcpys on every CPU (``state.buffers.copy_host``), the rest with ``copy_``."""
    for dst, src in copy_host([(view(buf, slot), tensors[slot.name].data) for slot in slots]):
        dst.copy_(src)


def _copy_device_slot(buf: torch.Tensor, slot: Slot, src: torch.Tensor, boundaries: tuple[int, ...]) -> None:
    """Queue the copy of one device tensor into its slot on the current (side) stream, split
    so that no single copy crosses from one page-locked chunk into the next."""
    if slot.begin == slot.end:
        return
    at = slot.staged  # in the buffer: aligned for the copy engine (``STAGING_ALIGN``)
    if not src.is_contiguous():
        # torch would do the same inside copy_ (a device-to-host copy needs a dense source):
        # a full-size temporary on the source GPU. Made here, explicitly, on the side stream
        # (the current stream in this context), so the allocator reuses its block for the
        # next non-contiguous tensor in stream order: at most one such temporary is live.
        src = src.contiguous()
    flat = src.reshape(-1).view(torch.uint8)
    for begin, end in split_at(at, at + slot.end - slot.begin, boundaries):
        buf[begin:end].copy_(flat[begin - at : end - at], non_blocking=True)


def group_by_device(slots: tuple[Slot, ...], devices: Mapping[str, torch.device]) -> dict[int, list[Slot]]:
    """The slots by source device: the CUDA device index, or ``HOST`` for tensors copied
    synchronously (host memory, other accelerators). Order within a group is the layout's (ascending offsets)."""
    groups: dict[int, list[Slot]] = {}
    for slot in slots:
        d = devices[slot.name]
        # Other accelerators (MPS, XPU) have no side stream here: their copy_ to the host
        # is synchronous, so they are copied like host tensors.
        key = (d.index if d.index is not None else _current_or_zero()) if d.type == "cuda" else HOST
        groups.setdefault(key, []).append(slot)
    return groups


def _current_or_zero() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def pin_device(devices: list[torch.device], *, local_rank: str | None, device_count: int, current: int) -> int:
    """The CUDA device under which to page-lock the buffer: the first GPU a tensor lives on;
    else ``LOCAL_RANK`` (the common ``model.to(local_rank)`` without ``set_device`` leaves
    the current device at 0 on every rank) when it names an existing device; else the
    current one. Registering under a device creates its context if needed, which is why a
    rank must never default to GPU 0."""
    for d in devices:
        if d.type == "cuda":
            return d.index if d.index is not None else current
    if local_rank is not None and local_rank.strip().isdigit() and int(local_rank) < device_count:
        return int(local_rank)
    return current
