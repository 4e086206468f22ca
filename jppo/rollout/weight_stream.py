"""The policy's weights from the trainer to vLLM servers in other processes, over one ``torch.distributed`` group.

The trainer is rank 0 of a group whose other ranks are the servers (:mod:`jppo.rollout.vllm_server`); it hosts the
group's rendezvous store. The transport is one code path for every machine: gloo between CPU processes, NCCL
between GPUs, so what the CPU tests exercise is what a GPU node runs.

**The stream.** Named tensors are packed into buckets of at most ``bucket_bytes`` (a tensor larger than that is a
bucket of its own), so the transfer's memory on either side is one bucket, not the model. Each bucket is three
broadcasts from rank 0: a header ``[index_bytes, data_bytes]`` (int64), the index (JSON bytes: each tensor's name,
dtype, shape and offset) and the data (the tensors' bytes back to back). A header ``[0, 0]`` ends the stream. The
receiver needs nothing in advance: the index of each bucket arrives with it.

Every collective is bounded: the group is made with ``timeout_s`` (gloo raises when a send or receive waits
longer; a rank that never joins fails the group's creation after the same time), so a server that dies or never
takes part turns into an error, never a hang (:class:`StreamError` says how many bytes had gone).

Nothing here imports JAX: the servers run without it.
"""

from __future__ import annotations

import datetime
import json
from typing import Iterable, Iterator

# the tensors' dtypes by name (the index is JSON), as the checkpoints jppo writes hold them
DTYPES = ("float32", "bfloat16", "float16", "float64", "int32", "int64")


class StreamError(RuntimeError):
    """A collective of the stream that failed or timed out."""


def torch_dtype(name: str):
    import torch  # noqa: PLC0415 (the trainer imports torch only when it streams)

    if name not in DTYPES:
        raise StreamError(f"a tensor of dtype {name!r} cannot be streamed (dtypes: {', '.join(DTYPES)})")
    return getattr(torch, name)


def open_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float, name: str):
    """This rank's handle on the group ``name`` (rank 0 hosts the store at ``host:port``): a gloo or NCCL process
    group of its own, beside (never replacing) a default group the process may have (vLLM makes one)."""
    import torch.distributed as dist  # noqa: PLC0415

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(name, store)
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world, timeout)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, world, options)
    except Exception as error:  # noqa: BLE001 (a rank that never came, a port taken: one line)
        raise StreamError(f"the weight group {name} ({world} ranks, {backend}, store {host}:{port}) did not form "
                          f"within {timeout_s:g} s: {str(error).splitlines()[0][:300]}") from None
    raise ValueError(f"backend={backend!r}: gloo or nccl")


def store_server(host: str, port: int, world: int, timeout_s: float):
    """The rendezvous store rank 0 hosts (kept alive by the caller while the group lives)."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.TCPStore(host, port, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _broadcast(group, tensor) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _buckets(tensors: Iterable[tuple[str, object]], bucket_bytes: int) -> Iterator[list[tuple[str, object]]]:
    bucket, size = [], 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def send(group, tensors: Iterable[tuple[str, object]], bucket_bytes: int, device: str = "cpu") -> int:
    """Broadcasts ``(name, torch tensor)`` pairs as the stream (see the module docstring) from rank 0 and ends it;
    returns the bytes of tensor data sent. ``device``: where the buffers live (``cuda`` for NCCL)."""
    import torch  # noqa: PLC0415

    sent = 0
    try:
        for bucket in _buckets(tensors, bucket_bytes):
            index, offset = [], 0
            for name, tensor in bucket:
                nbytes = tensor.numel() * tensor.element_size()
                index.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
                offset += nbytes
            data = torch.empty(offset, dtype=torch.uint8, device=device)
            for (name, tensor), (_, _, _, start) in zip(bucket, index):
                flat = tensor.contiguous().reshape(-1).view(torch.uint8)
                data[start: start + flat.numel()].copy_(flat)
            text = torch.frombuffer(bytearray(json.dumps(index).encode()), dtype=torch.uint8).to(device)
            _broadcast(group, torch.tensor([text.numel(), offset], dtype=torch.int64, device=device))
            _broadcast(group, text)
            _broadcast(group, data)
            sent += offset
        _broadcast(group, torch.zeros(2, dtype=torch.int64, device=device))
    except StreamError:
        raise
    except Exception as error:  # noqa: BLE001 (gloo's timeout, a peer gone)
        raise StreamError(f"after {sent} bytes: {str(error).splitlines()[0][:300]}") from None
    return sent


def receive(group, device: str = "cpu") -> Iterator[tuple[str, object]]:
    """The stream rank 0 sends, as ``(name, tensor)`` pairs, one bucket in memory at a time (each tensor a view of
    its bucket's buffer: consume it, e.g. copy it into a model, before asking for the next bucket)."""
    import torch  # noqa: PLC0415

    received = 0
    while True:
        try:
            header = torch.zeros(2, dtype=torch.int64, device=device)
            _broadcast(group, header)
            index_bytes, data_bytes = (int(v) for v in header.tolist())
            if not index_bytes:
                return
            text = torch.empty(index_bytes, dtype=torch.uint8, device=device)
            _broadcast(group, text)
            data = torch.empty(data_bytes, dtype=torch.uint8, device=device)
            _broadcast(group, data)
        except Exception as error:  # noqa: BLE001
            raise StreamError(f"after {received} bytes: {str(error).splitlines()[0][:300]}") from None
        received += data_bytes
        for name, dtype, shape, start in json.loads(text.cpu().numpy().tobytes().decode()):
            kind = torch_dtype(dtype)
            count = 1
            for size in shape:
                count *= size
            nbytes = count * torch.empty((), dtype=kind).element_size()
            yield name, data[start: start + nbytes].view(kind).reshape(shape)
