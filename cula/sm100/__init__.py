"""The SM100 (Blackwell) layer of the chunk family: the chunk forwards and a per-chunk gradient kernel, tcgen05 MMAs
with their accumulators in tensor memory (TMEM), TMA loads, warp roles and ``cutlass.pipeline`` hand-offs. Compiled for
``sm_100a`` and ``sm_103a`` on any machine; no Blackwell GPU has run these kernels, so dispatch serves them only with
``CULA_UNTESTED_KERNELS=1``."""
