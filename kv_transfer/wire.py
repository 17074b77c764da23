"""The one place messages cross to and from protobuf (`pdcluster.v1` KV messages); only transports call it."""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import InvalidRequestError
from engine.kv_export import KVLayout
from kv_transfer.messages import Abort, Chunk, Commit, NixlTarget, Prepared, PrepareRequest, TorchRendezvous
from kv_transfer.payload import Buffer
from kv_transfer.state import TRANSPORTS, Transport
from kv_transfer.v1 import kv_transfer_pb2 as pb


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(scope=layout.scope, dtype=layout.dtype, num_layers=layout.num_layers,
                       block_size=layout.block_size, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.scope, msg.dtype, msg.num_layers, msg.block_size, msg.num_kv_heads, msg.head_dim)


def prepare_to_proto(req: PrepareRequest) -> pb.PrepareRequest:
    return pb.PrepareRequest(request_id=req.request_id, layout=layout_to_proto(req.layout), token_ids=req.token_ids,
                             num_prompt_tokens=req.num_prompt_tokens, block_hashes=req.block_hashes,
                             transport=req.transport, deadline_ms=req.deadline_ms, sender_id=req.sender_id,
                             nixl_agent=req.nixl_agent, nixl_known=req.nixl_known,
                             attempt_id=req.attempt_id, lora=req.lora, nixl_shards=req.nixl_shards,
                             nixl_heads=_flat(req.nixl_heads))


def prepare_from_proto(msg: pb.PrepareRequest) -> PrepareRequest:
    """A peer's handshake; a missing layout or an unknown transport is refused here, naming the field."""
    rid = msg.request_id or None
    if not msg.HasField("layout"):
        raise InvalidRequestError("layout", "is required", rid)
    return PrepareRequest(msg.request_id, layout_from_proto(msg.layout), list(msg.token_ids), msg.num_prompt_tokens,
                          list(msg.block_hashes), transport_from_proto(msg.transport, rid), msg.deadline_ms,
                          msg.sender_id, msg.nixl_agent, msg.nixl_known, msg.attempt_id, msg.lora,
                          max(1, msg.nixl_shards), _pairs(msg.nixl_heads))


def _flat(pairs: list[tuple[int, int]]) -> list[int]:
    """Head ranges (first, stop) per rank as the proto's flat list."""
    return [h for pair in pairs for h in pair]


def _pairs(flat: Sequence[int]) -> list[tuple[int, int]]:
    """The proto's flat list of head ranges as (first, stop) per rank (an odd last number is dropped: the receiver
    then finds fewer ranges than ranks, and says so)."""
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat) - 1, 2)]


def transport_from_proto(name: str, request_id: str | None) -> Transport:
    for t in TRANSPORTS:
        if name == t:
            return t
    raise InvalidRequestError("transport", f"must be one of {', '.join(TRANSPORTS)}, got {name!r}", request_id)


def prepared_to_proto(resp: Prepared) -> pb.PrepareResponse:
    msg = pb.PrepareResponse(transfer_id=resp.transfer_id, cached_blocks=resp.cached_blocks,
                             num_blocks=resp.num_blocks)
    if (rv := resp.torch) is not None:
        msg.torch.CopyFrom(pb.TorchRendezvous(host=rv.host, port=rv.port, group_key=rv.group_key,
                                              backend=rv.backend, tag=rv.tag, device=rv.device))
    if (nx := resp.nixl) is not None:
        msg.nixl.CopyFrom(pb.NixlTarget(agent=nx.agent, metadata=nx.metadata, kv_addr=nx.kv_addr,
                                        pool_blocks=nx.pool_blocks, mem_type=nx.mem_type, device_id=nx.device_id,
                                        block_ids=nx.block_ids, shard_addrs=nx.shard_addrs, cuda_ipc=nx.cuda_ipc,
                                        shard_heads=_flat(nx.shard_heads)))
    return msg


def prepared_from_proto(msg: pb.PrepareResponse) -> Prepared:
    rv = msg.torch
    torch = (TorchRendezvous(rv.host, rv.port, rv.group_key, rv.backend, rv.tag, rv.device)
             if msg.HasField("torch") else None)
    nx = msg.nixl
    nixl = (NixlTarget(nx.agent, bytes(nx.metadata), nx.kv_addr, nx.pool_blocks, nx.mem_type, nx.device_id,
                       list(nx.block_ids), list(nx.shard_addrs), bytes(nx.cuda_ipc), _pairs(nx.shard_heads))
            if msg.HasField("nixl") else None)
    return Prepared(msg.transfer_id, msg.cached_blocks, msg.num_blocks, torch, nixl)


# NOTE: KVChunk.data is field 15, length-delimited. Its bytes are framed by hand so that a chunk costs one copy
# into the message on the way out and none on the way in (a memoryview); every other field goes through protobuf.
_DATA_KEY = (15 << 3) | 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("KVChunk: truncated or overlong varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def chunk_to_wire(chunk: Chunk, data: Buffer) -> bytes:
    """A serialized KVChunk: the described fields through protobuf, then `data` (the one copy of the bytes)."""
    head = pb.KVChunk(transfer_id=chunk.transfer_id, layer=chunk.layer, kv=chunk.kv, first_block=chunk.first_block,
                      num_blocks=chunk.num_blocks, crc32c=chunk.crc32c).SerializeToString()
    return b"".join((head, _varint(_DATA_KEY), _varint(len(data)), data))


def chunk_from_wire(buf: bytes) -> tuple[Chunk, memoryview]:
    """A serialized KVChunk (any field order) as its description and a view of its data (no copy)."""
    view, pos, keep, start = memoryview(buf), 0, [], 0
    data = view[:0]
    while pos < len(view):
        key, p = _read_varint(view, pos)
        wire_type = key & 7
        if wire_type == 0:
            p = _read_varint(view, p)[1]
        elif wire_type in (1, 5):
            p += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            n, p = _read_varint(view, p)
            p += n
            if key == _DATA_KEY:  # NOTE: as in protobuf, the last occurrence of a field wins
                keep.append(view[start:pos])
                data, start = view[p - n : p], p
        else:
            raise ValueError(f"KVChunk: unsupported wire type {wire_type}")
        if p > len(view):
            raise ValueError("KVChunk: truncated field")
        pos = p
    keep.append(view[start:])
    msg = pb.KVChunk.FromString(b"".join(keep))
    return Chunk(msg.transfer_id, msg.layer, msg.kv, msg.first_block, msg.num_blocks, msg.crc32c), data


def commit_to_proto(req: Commit) -> pb.CommitRequest:
    return pb.CommitRequest(transfer_id=req.transfer_id, next_token_ids=req.next_token_ids,
                            num_cached_tokens=req.num_cached_tokens)


def commit_from_proto(msg: pb.CommitRequest) -> Commit:
    return Commit(msg.transfer_id, list(msg.next_token_ids), msg.num_cached_tokens)


def abort_to_proto(req: Abort) -> pb.AbortRequest:
    return pb.AbortRequest(transfer_id=req.transfer_id, reason=req.reason, quiesced=req.quiesced,
                           attempt_id=req.attempt_id)


def abort_from_proto(msg: pb.AbortRequest) -> Abort:
    return Abort(msg.transfer_id, msg.reason, msg.quiesced, msg.attempt_id)
