"""tools/ncu_report.py's mapping of profiled machine code onto source lines (CPU only)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import ncu_report  # noqa: E402

DISASSEMBLY = """
        //## File "/src/cula/sm90/state.py", line 57
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 STG.E desc[UR4][R2.64], R5 ;
        //## File "/src/cula/gla/chunk_fwd_sm90.py", line 168
        /*0020*/                   SYNCS.PHASECHK.TRANS64 P0, [UR4], R3 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
        //## File "/src/cula/kda/chunk_fwd_sm90.py", line 660
        /*0040*/                   FADD R4, R4, R6 ;
"""


def test_opcodes_drop_predicates_and_operands():
    assert ncu_report.opcode("@!P1 LDG.E.64 R2, desc[UR4][R4.64] ;") == "LDG.E.64"
    assert ncu_report.opcode("  EXIT ;") == "EXIT"
    assert ncu_report.opcode("") == ""


def test_the_listing_names_each_instructions_line_with_its_folder():
    assert ncu_report.line_listing(DISASSEMBLY) == [
        ("LDC", "sm90/state.py:57"),
        ("STG.E", "sm90/state.py:57"),
        ("SYNCS.PHASECHK.TRANS64", "gla/chunk_fwd_sm90.py:168"),
        ("BAR.SYNC.DEFER_BLOCKING", "gla/chunk_fwd_sm90.py:168"),
        ("FADD", "kda/chunk_fwd_sm90.py:660"),
    ]


def test_profiled_code_scheduled_otherwise_still_finds_its_lines():
    listing = ncu_report.line_listing(DISASSEMBLY)
    # the profiled machine's compiler added an instruction after the store and dropped the barrier
    profiled = ["LDC", "STG.E", "IMAD", "SYNCS.PHASECHK.TRANS64", "FADD"]
    assert ncu_report.align_lines(profiled, listing) == [
        "sm90/state.py:57",
        "sm90/state.py:57",
        "~sm90/state.py:57",
        "gla/chunk_fwd_sm90.py:168",
        "kda/chunk_fwd_sm90.py:660",
    ]
