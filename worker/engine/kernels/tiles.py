"""The tile unit (AMX) where the CPU has it: a unit's integer products with sixteen rows at once.

A tile product multiplies a tile of 16 activation rows by 32 int8 values (A) by a Q8_0 unit's
eight group vectors (B, 8 rows of 64 bytes: ``panels.py`` lays a panel's weights out exactly as
the tile unit reads them, four weights of each of the 16 outputs a row) into 16 × 16 int32
sums, the same integers ``dot_prepared_signed`` builds lane by lane, so the GEMM (``gemm.py``)
takes them through the same float steps and every row's result is bit for bit the vector
loop's. Used only where the CPU has AMX-TILE and AMX-INT8, the kernel (Linux 5.16
and later) lets this process use the tile registers, 512-bit vectors make a panel 16 outputs,
and ``LMSERVE_TILES`` is not ``0``; ``kernels.use_tiles`` decides, once, before anything
compiles.

The tiles hold, as ``configuration`` sets them up (palette 1):

    tmm0  the products        16 rows × 64 bytes (16 int32)
    tmm1  activations         16 rows × 32 bytes (one unit)
    tmm2  levels               8 rows × 64 bytes

Attention's bfloat16 products (``attention._attend_task_tiles``, where the CPU also has
AMX-BF16) configure the tiles their own way (``ATTENTION_CONFIGURATION``: float sums, A and B,
each 16 rows of 64 bytes) at the start of each task, as the GEMM does at the start of each
panel; the sums stay in tmm0 between calls of one thread.

The instructions reach LLVM as inline assembly (numba has no AMX types).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.extending import intrinsic

from worker.engine.kernels.simd import address_of

ROWS = 16  # activation rows a tile product takes
_I64 = ir.IntType(64)

binding.initialize_native_asmparser()  # LLVM parses inline assembly only with it


def configuration() -> np.ndarray:
    """The 64-byte tile configuration (``ldtilecfg``'s operand) of the table above."""
    config = np.zeros(64, dtype=np.uint8)
    config[0] = 1  # palette 1
    shapes = [(16, 64), (16, 32), (8, 64)]
    for tile, (rows, row_bytes) in enumerate(shapes):
        config[16 + 2 * tile:18 + 2 * tile] = np.frombuffer(np.uint16(row_bytes).tobytes(), np.uint8)
        config[48 + tile] = rows
    return config


CONFIGURATION = configuration()


@njit(inline="always", cache=True)
def lined(count, dtype):
    """An uninitialized array of ``count`` values of ``dtype`` whose first lies on a cache line (64
    bytes), for scratch that tiles or 512-bit vectors move: each row then whole lines. numba
    aligns its arrays to 32 bytes; attention's tile path with scratch half a line off took up to
    1.5x as long, by where the arrays happened to lie."""
    space = np.empty(count + 64, dtype=dtype)
    skip = (-space.ctypes.data % 64) // space.itemsize
    return space[skip:skip + count]


def _run(builder: ir.IRBuilder, text: str, operands: list[ir.Value]) -> None:
    kinds = ",".join(["r"] * len(operands) + ["~{memory}"])
    fnty = ir.FunctionType(ir.VoidType(), [op.type for op in operands])
    builder.call(ir.InlineAsm(fnty, text, kinds, side_effect=True), operands)


def _address(context, builder, array_type, array, byte_offset) -> ir.Value:
    return builder.ptrtoint(address_of(context, builder, array_type, array, byte_offset), _I64)


def _i64(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    return builder.sext(value, _I64) if value.type.width < 64 else value


@intrinsic
def configure(typingctx, config):
    """Set up this thread's tiles (``ldtilecfg``) from ``config``."""
    def codegen(context, builder, sig, args):
        _run(builder, "ldtilecfg ($0)", [_address(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))])
        return context.get_dummy_value()
    return types.none(config), codegen


@intrinsic
def release(typingctx):
    """Give the tiles back (``tilerelease``): the thread's state is small again."""
    def codegen(context, builder, sig, args):
        _run(builder, "tilerelease", [])
        return context.get_dummy_value()
    return types.none(), codegen


def _product(instruction: str):
    def typer(typingctx, activations, a_at, a_stride, levels, b_at, products, c_at):
        """products (16 rows of 16 int32 from byte ``c_at``, 64 bytes apart) = the 16 activation
        rows of 32 bytes from byte ``a_at``, ``a_stride`` bytes apart, times the 8 × 64 bytes of
        levels from byte ``b_at``."""
        def codegen(context, builder, sig, args):
            a = _address(context, builder, sig.args[0], args[0], _i64(builder, args[1]))
            b = _address(context, builder, sig.args[3], args[3], _i64(builder, args[4]))
            c = _address(context, builder, sig.args[5], args[5], _i64(builder, args[6]))
            _run(builder, "tilezero %tmm0\n\ttileloadd ($0,$1,1), %tmm1\n\ttileloadd ($2,$3,1), %tmm2\n\t"
                          f"{instruction} %tmm2, %tmm1, %tmm0\n\ttilestored %tmm0, ($4,$3,1)",
                 [a, _i64(builder, args[2]), b, ir.Constant(_I64, 64), c])
            return context.get_dummy_value()
        return types.none(activations, a_at, a_stride, levels, b_at, products, c_at), codegen
    return typer


# signed activations against signed weights (Q8_0)
product_signed = intrinsic(_product("tdpbssd"))


# --- bfloat16 products for attention (AMX-BF16) -----------------------------------------------------

def attention_configuration() -> np.ndarray:
    """Attention's tiles: tmm0 the float sums, tmm1 A, tmm2 B, each 16 rows × 64 bytes (16
    floats, or 32 bfloat16 as 16 pairs)."""
    config = np.zeros(64, dtype=np.uint8)
    config[0] = 1
    for tile in range(3):
        config[16 + 2 * tile:18 + 2 * tile] = np.frombuffer(np.uint16(64).tobytes(), np.uint8)
        config[48 + tile] = 16
    return config


ATTENTION_CONFIGURATION = attention_configuration()


@intrinsic
def zero_sums(typingctx):
    """tmm0 = 0."""
    def codegen(context, builder, sig, args):
        _run(builder, "tilezero %tmm0", [])
        return context.get_dummy_value()
    return types.none(), codegen


def _sums_moved(instruction: str):
    def typer(typingctx, array, byte_offset, stride):
        def codegen(context, builder, sig, args):
            _run(builder, instruction,
                 [_address(context, builder, sig.args[0], args[0], _i64(builder, args[1])), _i64(builder, args[2])])
            return context.get_dummy_value()
        return types.none(array, byte_offset, stride), codegen
    return intrinsic(typer)


# tmm0 = 16 rows of 16 floats from byte ``byte_offset`` of ``array``, ``stride`` bytes apart
load_sums = _sums_moved("tileloadd ($0,$1,1), %tmm0")
# tmm0's 16 rows of 16 floats into ``array`` from byte ``byte_offset``, ``stride`` bytes apart
store_sums = _sums_moved("tilestored %tmm0, ($0,$1,1)")


@intrinsic
def add_bf16_product(typingctx, a, a_at, a_stride, b, b_at):
    """tmm0 += A · B: A 16 rows of 32 bfloat16 from byte ``a_at`` of ``a``, ``a_stride`` bytes
    apart; B 16 rows of 16 bfloat16 pairs (64 bytes a row, one after another) from byte
    ``b_at`` of ``b``. Sum (m, n) gains Σ_k A[m, 2k]·B[k, 2n] + A[m, 2k+1]·B[k, 2n+1], products
    exact in float32."""
    def codegen(context, builder, sig, args):
        _run(builder, "tileloadd ($0,$1,1), %tmm1\n\ttileloadd ($2,$3,1), %tmm2\n\ttdpbf16ps %tmm2, %tmm1, %tmm0",
             [_address(context, builder, sig.args[0], args[0], _i64(builder, args[1])), _i64(builder, args[2]),
              _address(context, builder, sig.args[3], args[3], _i64(builder, args[4])), ir.Constant(_I64, 64)])
        return context.get_dummy_value()
    return types.none(a, a_at, a_stride, b, b_at), codegen
