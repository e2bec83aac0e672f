"""Context parallelism: ring attention over a sequence sharded across GPUs (docs/context-parallelism.md).

    from cupyflash.distributed import LocalRing, ring_flash_attn_func, zigzag_shard, zigzag_unshard

    ring = LocalRing(4)                                    # 4 simulated ranks (NumPy), one process
    shards = [zigzag_shard(x, 4) for x in (q, k, v)]       # causal: zigzag layout
    o = zigzag_unshard(ring.run(lambda comm: ring_flash_attn_func(
        shards[0][comm.rank], shards[1][comm.rank], shards[2][comm.rank], comm=comm, causal=True)))

- ``ring_flash_attn_func``, ``ring_flash_attn_backward``, ``ring_flash_attn_vjp``: each rank's
  call on its shards (ring.py).
- Communicators (comm.py): ``NcclRingComm`` (NCCL through CuPy, one process per GPU, or inside a
  torch.distributed job), ``LocalRing`` (P ranks in one process: NumPy simulation, or one GPU).
- ``launch``: one process per GPU with an NCCL communicator each, no torch (launch.py).
- ``zigzag_shard`` / ``zigzag_unshard``, ``contiguous_shard`` / ``contiguous_unshard``.
- ``merge_attention_states``: the LSE-rule merge (cupyflash.merge), re-exported.
"""
from ..merge import merge_attention_states
from .comm import LocalRing, LocalRingComm, NcclRingComm, Pending, RingAborted, RingComm
from .launch import launch
from .ring import RingBlock, RingStep, ring_flash_attn_backward, ring_flash_attn_func, ring_flash_attn_vjp, ring_schedule
from .sharding import contiguous_shard, contiguous_unshard, zigzag_shard, zigzag_unshard

__all__ = ["ring_flash_attn_func", "ring_flash_attn_backward", "ring_flash_attn_vjp", "ring_schedule", "RingStep", "RingBlock",
           "RingComm", "Pending", "LocalRing", "LocalRingComm", "NcclRingComm", "RingAborted", "launch",
           "zigzag_shard", "zigzag_unshard", "contiguous_shard", "contiguous_unshard", "merge_attention_states"]
