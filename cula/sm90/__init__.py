"""The SM90 (Hopper) layer shared by every chunk kernel of the family (GDN, KDA, and next GLA and Lightning).

- :mod:`cula.sm90.roles`: warp-group roles, named barriers and register budgets.
- :mod:`cula.sm90.pipeline`: the hand-offs between roles as ``cutlass.pipeline`` rings.
- :mod:`cula.sm90.tiles`, :mod:`cula.sm90.mma`: token tiles, TMA copies, wgmma helpers.
- :mod:`cula.sm90.solve`: the chunk's triangular inverse.
- :mod:`cula.sm90.state`, :mod:`cula.sm90.state_chain`, :mod:`cula.sm90.epilogue`: the state in registers, the
  per-chunk state products, the output's way out.
- :mod:`cula.sm90.workspace`, :mod:`cula.sm90.sequence`: the split passes' workspace, a CTA's sequence.
- :mod:`cula.sm90.chunk_fwd`: the chunk-forward kernel skeleton; :mod:`cula.sm90.entry`: its host path.
"""
