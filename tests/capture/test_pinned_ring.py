"""The pinned ring hands out space in order, takes it back in order, wraps, refuses what
does not fit (the caller then pins fresh memory), and keeps out-of-order releases until
everything before them is released. Bookkeeping only: the buffer is unpinned here."""

from __future__ import annotations

import pytest
import torch

from enginetap.capture.writers.pinned import ALIGN, PinnedRing


def _ring(blocks: int) -> PinnedRing:
    return PinnedRing(blocks * ALIGN, pin=False)


def test_regions_are_consecutive_and_come_back_in_order() -> None:
    ring = _ring(4)
    a, b = ring.reserve(ALIGN), ring.reserve(ALIGN + 1)  # b takes two blocks
    assert (a.start, a.end, b.start, b.end) == (0, ALIGN, ALIGN, 3 * ALIGN)
    assert ring.reserve(2 * ALIGN) is None  # one block left
    a.release()
    c = ring.reserve(ALIGN)
    assert c is not None and c.start == 3 * ALIGN  # after head first
    d = ring.reserve(ALIGN)
    assert d is not None and d.start == 0  # then wraps into what a gave back
    assert ring.reserve(1) is None  # full: b, c, d held
    for region in (b, c, d):
        region.release()
    assert ring.held == 0 and ring.reserve(4 * ALIGN) is not None


def test_an_out_of_order_release_waits_for_the_ones_before_it() -> None:
    ring = _ring(3)
    a, b, c = (ring.reserve(ALIGN) for _ in range(3))
    b.release()  # dropped workload: released before a was written
    assert ring.held == 3 * ALIGN and ring.reserve(1) is None
    a.release()
    assert ring.held == ALIGN  # a and b come back together
    assert ring.reserve(2 * ALIGN).start == 0
    c.release()


def test_tensors_taken_from_a_region_hold_their_bytes() -> None:
    ring = _ring(8)
    region = ring.reserve(2 * ALIGN + 6)
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    y = torch.tensor([1, 2, 3], dtype=torch.int16)
    tx = region.take(0, x.shape, x.dtype)
    ty = region.take(2 * ALIGN, y.shape, y.dtype)
    tx.copy_(x)
    ty.copy_(y)
    assert torch.equal(tx, x) and torch.equal(ty, y)
    assert ring.reserve(8 * ALIGN) is None and ring.reserve(1) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_land_in_the_ring_and_give_it_back() -> None:
    from enginetap.capture.writers.copy import HostCopies
    from enginetap.capture.writers.pinned import ring_for

    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    ids = torch.arange(7, device="cuda", dtype=torch.int32)
    copies = HostCopies.of({"x": x, "ids": ids, "scale": 0.5}, ring_bytes=1 << 26)
    ring = ring_for(x.device, 1 << 26)
    assert copies.region is not None and ring is not None and ring.held > 0
    got = copies.wait()
    assert got["x"].is_pinned() and torch.equal(got["x"], x.cpu())
    assert torch.equal(got["ids"], ids.cpu()) and got["scale"] == 0.5
    copies.release()
    assert ring.held == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_keep_the_bytes_the_engine_overwrites_next() -> None:
    # The copies are queued on the engine's stream without waiting: an engine that writes
    # its tensor right after the capture must not change what was captured.
    from enginetap.capture.writers.copy import HostCopies

    x = torch.randn(2048, 4096, device="cuda")
    before = x.cpu()
    copies = HostCopies.of({"x": x}, ring_bytes=1 << 28)
    for _ in range(20):  # queued behind the capture on the engine's stream
        x.mul_(3.0).add_(1.0)
    got = copies.wait()
    assert torch.equal(got["x"], before)
    copies.release()


def test_a_shared_ring_is_seen_by_another_mapping_and_messages_round_trip() -> None:
    """The process writer's ring (a memfd) and its messages: a tensor in the ring is named
    by its offset and read where another mapping of the ring sees it; a tensor that found
    no room travels in the payload; scalars travel as they are."""
    import mmap

    from enginetap.capture.writers.copy import HostCopies
    from enginetap.capture.writers.pinned import shared_ring
    from enginetap.capture.writers.wire import describe_values, rebuild_values

    ring = shared_ring(4 * ALIGN, pin=False)
    other = torch.frombuffer(mmap.mmap(ring.fd, ring.capacity), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    values = {"x": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
              "ids": torch.arange(7, dtype=torch.int32), "flag": torch.ones((), dtype=torch.bool),
              "eps": 1e-6, "n": 3}
    copies = HostCopies.of(values, shared=ring)
    big = HostCopies.of({"y": torch.randn(64, 64, generator=gen)}, shared=ring)  # no room
    assert copies.region is not None and big.region is None
    payload = bytearray()
    message = {**describe_values(copies.wait(), ring, payload),
               **describe_values(big.wait(), ring, payload)}
    assert "ring" in message["x"] and "payload" in message["y"]
    assert message["eps"] == {"scalar": 1e-6}
    back = rebuild_values(message, other, bytes(payload))
    for name, value in {**values, "y": big.values["y"]}.items():
        if isinstance(value, torch.Tensor):
            assert back[name].dtype == value.dtype and torch.equal(back[name], value)
        else:
            assert back[name] == value
    copies.release()
    assert ring.held == 0


def test_one_workloads_groups_share_one_region_given_back_with_the_first() -> None:
    """Inputs, outputs and checks of one workload: one reservation holds all three groups,
    laid end to end; the region rides on the first group's copies, so giving the
    workload back (every group released) frees the ring once."""
    from enginetap.capture.writers.copy import HostCopies
    from enginetap.capture.writers.pinned import shared_ring

    ring = shared_ring(8 * ALIGN, pin=False)
    gen = torch.Generator().manual_seed(1)
    groups = [{"x": torch.randn(4, 8, generator=gen), "eps": 1e-6},
              {"out": torch.randn(4, 8, generator=gen)},
              {"0": torch.ones(1, dtype=torch.bool)}]
    made = HostCopies.of_groups(groups, shared=ring)
    assert [c.nbytes for c in made] == [128, 128, 1]
    assert made[0].region is not None and made[1].region is None and made[2].region is None
    assert ring.held == 3 * ALIGN  # one region, each group aligned within it
    starts = [c.values[n].data_ptr() - ring.base for c, n in zip(made, ("x", "out", "0"))]
    assert starts == [0, ALIGN, 2 * ALIGN]
    for copies, values in zip(made, groups):
        for name, value in values.items():
            got = copies.wait()[name]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
    for copies in made:
        copies.release()
    assert ring.held == 0


def test_a_shared_ring_that_cuda_cannot_pin_is_used_unpinned(monkeypatch, caplog) -> None:
    """Where registering the shared ring with CUDA fails, the ring still works (device
    copies into it then wait), and the log says why."""
    from enginetap.capture.writers import pinned

    def refuse():
        raise RuntimeError("no cudart binding in this build")

    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned.torch.cuda, "cudart", refuse)
    with caplog.at_level("WARNING", logger="enginetap.capture"):
        ring = pinned.shared_ring(4 * ALIGN, pin=True)
    assert not ring.pin and "cannot pin the shared capture ring" in caplog.text
    region = ring.reserve(ALIGN)
    assert region is not None
    region.take(0, torch.Size([4]), torch.int32).fill_(7)
    assert ring.buffer[:16].view(torch.int32).tolist() == [7, 7, 7, 7]


def test_the_process_writer_keeps_a_refused_workload_until_its_refusal_is_read(tmp_path) -> None:
    """The child says which workloads it is done with through a control word, and reports
    refusals through its output: a workload it refused must stay with the engine's process
    (its probe is disabled through it) until the receiver read the refusal, however the
    two race."""
    import time

    from enginetap.capture.writers.pinned import set_control
    from enginetap.capture.writers import ProcessWriter
    from enginetap.capture.writers.wire import DONE_WORD, REFUSALS_WORD

    writer = ProcessWriter(tmp_path / "ds", budget_bytes=1 << 20, pin=False)
    released: list[int] = []

    class Workload:
        nbytes = 10

        def release(self) -> None:
            released.append(1)

    ring = writer.ring
    try:
        writer._inflight.append((0, Workload()))  # type: ignore[arg-type]
        # the child: one refusal reported (not read yet), then workload 0 done
        set_control(ring._map, ring.capacity, 0, REFUSALS_WORD)  # type: ignore[arg-type]
        set_control(ring._map, ring.capacity, 0, DONE_WORD)  # type: ignore[arg-type]
        time.sleep(0.1)  # the sender thread looks at the control words meanwhile
        writer._reap()
        assert len(writer._inflight) == 1 and not released
        writer._refusals_read += 1  # what the receiver does once it read the refusal
        writer._reap()
        assert not writer._inflight and released == [1]
    finally:
        writer.close()


class _FailedDevice:
    """A copy event from a device that failed: asking about it raises, as CUDA does."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def synchronize(self) -> None:
        self.query()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_device_error_in_a_copy_stops_capture_and_says_so(tmp_path, writer) -> None:
    """A copy whose device failed never lands: the writer does not wait for it forever or
    die with a traceback; capture stops with the device's error, the workload dropped."""
    from enginetap.capture.writers.copy import HostCopies
    from enginetap.capture.writers import Item, ProcessWriter, ThreadWriter
    from enginetap.dataset import Dataset
    from enginetap.definitions import get_template

    definition = get_template("rmsnorm").instantiate(hidden_size=8)
    x = torch.ones(2, 8)
    inputs = HostCopies({"hidden_states": x, "weight": torch.ones(8), "eps": 1e-6},
                        event=_FailedDevice(), nbytes=72)
    outputs = HostCopies({"output": x}, nbytes=64)
    item = Item(definition, inputs, outputs, lambda: None)  # type: ignore[arg-type,return-value]
    made = (ThreadWriter(Dataset(tmp_path / "ds", create=True), budget_bytes=1 << 20)
            if writer == "thread" else
            ProcessWriter(tmp_path / "ds", budget_bytes=1 << 20, pin=False))
    assert made.submit(item)
    stats = made.close(timeout=60)
    assert "illegal memory access" in stats.error
    assert stats.written == 0 and made.held == 0
