"""The token-by-token forward kernel of every variant (decode, speculative verify): :mod:`cula.recurrent.kernel`,
its host side and registration :mod:`cula.recurrent.fwd_sm90` (SM90 and SM100: the kernel is SIMT)."""
