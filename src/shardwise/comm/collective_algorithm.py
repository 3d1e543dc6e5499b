"""Which algorithm a flat reduce-scatter or all-gather takes: measured, per backend and size.

:func:`choose_algorithm` is pure (it calls nothing in ``torch.distributed``); the collectives in
:mod:`shardwise.comm.collectives` ask it on every ``algorithm="auto"`` call.

On nccl (and any backend other than gloo on CPU tensors) the native collectives are used:
``reduce_scatter_single``/``all_gather_single`` where torch has them, else
``reduce_scatter_tensor``/``all_gather_into_tensor`` (the older names warn in torch 2.13).

On gloo groups of two ranks (CPU tensors), both go through :mod:`shardwise.comm.exchange`:
each rank sends its peer exactly the part the peer owns, point to point, which measured
about half the time of an in-place all-reduce from 4 MiB on (``benchmarks/collectives_bench.py``;
figures in that module). The table below compares the collectives that remain for other group sizes
(where the exchange is correct but not measured; pass ``algorithm="exchange"`` to use it).

On gloo, torch's native reduce-scatter and all-gather lose to an all-reduce of the whole
buffer once the buffer reaches 32 MiB. They allocate buffer-sized temporaries on every
call, and from 32 MiB (glibc's largest mmap threshold) every allocation is a fresh
``mmap`` whose pages fault in again: measured minor page faults per call (fp32, rank 0)
were 4.9K (native all-gather) and 6.3K (native reduce-scatter) at 24 MiB, 8.2K and 8.4K
at 32 MiB (8K pages = the whole buffer), against about 200 for the in-place all-reduce
forms at both sizes. So on gloo:

* reduce-scatter with ``input_is_scratch=True``: all-reduce the input in place, then copy
  this rank's slice out. It ties with the native collective below 32 MiB and wins above,
  so it is used at every size. With ``input_is_scratch=False`` it would need a copy of the
  input, which costs the same page faults (column "ar+copy") and never beat native, so
  native is used.
* all-gather: native below 32 MiB of output; at 32 MiB and above, zero the parts of the
  output this rank does not own, place the shard, and all-reduce with SUM. This is exact:
  every element is its owner's value plus zeros (the one visible difference: ``-0.0``
  comes back as ``+0.0``).

The crossover is a number of bytes, not of elements: fp32 and bf16 cross at the same
byte size. Measured here through these functions (2 gloo ranks on one 2-core machine
that other jobs shared, ``torch.set_num_threads(1)``, 11 interleaved rounds; each cell is
min / median ms of the slower rank; a second run gave the same picture). "ar+slice" is
the in-place all-reduce (``input_is_scratch=True``), "ar+copy" the same on a copy of the
input, "ag ar" the zero + place + all-reduce all-gather:

=====  ========  ====  ============  ============  ===========  ============  ============  ============
dtype  numel     MiB   all_reduce    rs native     rs ar+slice  rs ar+copy    ag native     ag ar
=====  ========  ====  ============  ============  ===========  ============  ============  ============
fp32   256K      1     1.3 / 7.4     1.7 / 8.0     1.3 / 2.2    1.5 / 2.4     1.2 / 3.2     1.6 / 6.4
fp32   4M        16    24.2 / 40.9   28.4 / 47.1   33.8 / 39.8  34.2 / 45.6   21.0 / 25.4   33.3 / 41.7
fp32   6M        24    50.5 / 61.9   65.7 / 88.2   46.1 / 69.5  67.5 / 84.6   33.8 / 47.8   60.1 / 72.6
fp32   8M        32    54.2 / 82.4   110 / 174     64.8 / 94.0  137 / 169     104 / 117     66.4 / 101
fp32   16M       64    94.5 / 109    268 / 319     104 / 135    238 / 384     178 / 297     96.8 / 171
bf16   256K      0.5   0.8 / 1.6     1.2 / 2.4     1.6 / 2.7    1.3 / 2.9     0.8 / 1.3     1.1 / 1.6
bf16   4M        8     11.1 / 15.5   13.3 / 20.1   11.9 / 19.3  11.9 / 17.5   7.4 / 11.2    12.7 / 15.1
bf16   12M       24    31.3 / 52.3   45.9 / 68.2   28.7 / 59.7  51.9 / 69.9   19.1 / 32.1   34.1 / 60.6
bf16   16M       32    43.1 / 63.1   95.5 / 138    49.0 / 76.4  96.6 / 147    82.7 / 115    55.9 / 71.8
bf16   32M       64    95.8 / 146    254 / 345     103 / 193    239 / 305     150 / 214     83.8 / 148
=====  ========  ====  ============  ============  ===========  ============  ============  ============

Below 32 MiB the in-place all-reduce and the native reduce-scatter are within noise of
each other (either can win a run); from 32 MiB on native loses by 1.7-2.6x. Native
all-gather wins clearly below 32 MiB (it moves half the bytes) and loses from 32 MiB on.
(The lead's earlier measurement, 16M fp32 elements: all-reduce 113 ms, native
reduce-scatter 227 ms, native all-gather 222 ms, agrees.) The threshold was measured
with two ranks only; with more ranks an all-reduce moves up to twice the bytes of a
reduce-scatter, so re-measure there. To force one algorithm (benchmarks, tests), pass
``algorithm="native"``, ``"all_reduce"`` or ``"exchange"``.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["GLOO_ALL_GATHER_VIA_ALL_REDUCE_MIN_BYTES", "Algorithm", "AlgorithmChoice", "choose_algorithm"]

Algorithm = Literal["native", "all_reduce", "exchange"]
AlgorithmChoice = Literal["auto", "native", "all_reduce", "exchange"]

# Gloo's native all-gather falls off glibc's 32 MiB mmap cliff (see the module docstring).
GLOO_ALL_GATHER_VIA_ALL_REDUCE_MIN_BYTES = 32 * 1024 * 1024


def choose_algorithm(
    collective: Literal["reduce_scatter", "all_gather"],
    backend: str,
    device_type: str,
    nbytes: int,
    *,
    input_is_scratch: bool = False,
    world_size: int | None = None,
) -> Algorithm:
    """Pick the faster algorithm for one call from the measurements in the module docstring.

    Args:
        collective: ``"reduce_scatter"`` or ``"all_gather"``.
        backend: the group's backend name (``dist.get_backend(group)``).
        device_type: the tensors' device type (``"cpu"``, ``"cuda"``).
        nbytes: bytes of the full (unsharded) buffer.
        input_is_scratch: reduce-scatter only: the input may be overwritten.
        world_size: the group's size (None: not known).

    Returns:
        ``"native"``, ``"all_reduce"`` or ``"exchange"``.

    Example:
        >>> choose_algorithm("all_gather", "gloo", "cpu", 64 * 2**20, world_size=4)
        'all_reduce'
        >>> choose_algorithm("reduce_scatter", "gloo", "cpu", 2**20, world_size=2)
        'exchange'
        >>> choose_algorithm("all_gather", "nccl", "cuda", 64 * 2**20)
        'native'
    """
    if device_type != "cpu" or "gloo" not in backend:
        return "native"
    if world_size == 2 and collective in ("reduce_scatter", "all_gather"):
        return "exchange"  # about 0.5x an all-reduce from 4 MiB on (benchmarks/collectives_bench.py)
    if collective == "reduce_scatter":
        return "all_reduce" if input_is_scratch else "native"
    if collective == "all_gather":
        return "all_reduce" if nbytes >= GLOO_ALL_GATHER_VIA_ALL_REDUCE_MIN_BYTES else "native"
    raise ValueError(f"unknown collective {collective!r}: use 'reduce_scatter' or 'all_gather'")
