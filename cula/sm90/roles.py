"""Warp-group roles, named barriers and register budgets of the SM90 chunk kernels.

A kernel of the family is a row of 128-thread warpgroups, each with one role (:class:`WarpGroupRole`), producer
first. Roles hand data to each other through :mod:`cula.sm90.pipeline` rings; a role's warpgroups synchronise among
themselves through the named barriers of :class:`Barrier` (and a gate policy's own, numbered from
:data:`FIRST_POLICY_BARRIER`). Registers move between roles with ``setmaxnreg``: the light roles give theirs back, the
state warpgroups take what the launch's pool has left (:func:`register_budget`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import cutlass.cute as cute

WARPGROUP = 128
REGISTER_FILE = 65536  # 32-bit registers per SM, the pool a CTA's threads share
MAX_REGISTERS = 256  # setmaxnreg's ceiling per thread


class WarpGroupRole(enum.IntEnum):
    """What a warpgroup does each chunk."""

    PRODUCER = 0  # TMA loads and the gate's per-chunk preparation (scan, factors, gated tiles)
    INTRA = 1  # the intra-chunk matrices A and P and Tinv = (I + A)^-1, a chunk ahead of the state
    STATE = 2  # value rows of S^T in registers and the per-chunk state products


class Barrier(enum.IntEnum):
    """Named barriers shared by the family (id 0 is the CTA's ``bar.sync``)."""

    STATE = 1  # the state warpgroups among themselves (solve steps, output staging)
    INTRA = 2  # the intra warpgroup's steps
    PRODUCER = 3  # the producer warpgroup's steps


FIRST_POLICY_BARRIER = 4  # a gate policy's own named barriers are numbered from here (hardware: 16)


def register_budget(roles: tuple[WarpGroupRole, ...], wants: dict[WarpGroupRole, int]) -> dict[WarpGroupRole, int]:
    """``setmaxnreg`` per thread for each role: ``wants`` for the roles named there, and the state warpgroups the rest
    of the launch's pool, shared evenly (multiples of 8, at most 256). The pool is what ptxas gives each thread of a
    CTA of this size (the register file over the threads, rounded down to 8) times the threads: asking for more than
    it holds would hang ``setmaxnreg.inc``."""
    per_thread = REGISTER_FILE // (WARPGROUP * len(roles)) // 8 * 8
    pool = per_thread * len(roles)
    rest = pool - sum(wants[r] for r in roles if r != WarpGroupRole.STATE)
    n_state = roles.count(WarpGroupRole.STATE)
    state = min(MAX_REGISTERS, rest // n_state // 8 * 8)
    budget = {**wants, WarpGroupRole.STATE: state}
    assert sum(budget[r] for r in roles) <= pool and all(24 <= budget[r] <= MAX_REGISTERS for r in roles), budget
    return budget


@dataclass(frozen=True)
class RoleLayout:
    """The warpgroups of a kernel in thread order (producer first) and each role's registers per thread."""

    roles: tuple[WarpGroupRole, ...]
    registers: dict

    @classmethod
    def make(cls, roles: tuple[WarpGroupRole, ...], wants: dict[WarpGroupRole, int]) -> RoleLayout:
        return cls(roles, register_budget(roles, wants))

    @property
    def threads(self) -> int:
        return WARPGROUP * len(self.roles)

    def count(self, role: WarpGroupRole) -> int:
        """Warpgroups of ``role``."""
        return self.roles.count(role)

    def first_warpgroup(self, role: WarpGroupRole) -> int:
        return self.roles.index(role)

    def threads_of(self, role: WarpGroupRole) -> int:
        return WARPGROUP * self.count(role)

    def warps_of(self, role: WarpGroupRole) -> int:
        return self.threads_of(role) // 32

    def enter(self, role: WarpGroupRole) -> None:
        """``setmaxnreg`` on entering ``role``'s code (traced inline): down for the light roles, up for the state
        warpgroups."""
        if role == WarpGroupRole.STATE:
            cute.arch.setmaxregister_increase(self.registers[role])
        else:
            cute.arch.setmaxregister_decrease(self.registers[role])
