"""SIMD vectors as wide as the machine's: 512 bits where the CPU has AVX-512BW, else 256.

WIDTH (called PANEL where it counts outputs) is the number of 32-bit lanes: 16 or 8. Two users:

* the GEMM (``gemm.py``): a panel is PANEL consecutive output rows of a weight matrix, one lane
  per output. ``panels.py`` repacks the weights so that the four weights of an output that one
  lane of an int8 dot product takes lie side by side: a *group vector* holds four consecutive
  weights (bytes) of every output of the panel, LANES = 4 × PANEL bytes, and the four matching
  activation bytes are broadcast to every lane (``splat_quad``). Eight group vectors make a
  32-weight unit; its integer product with an activation block accumulates, lane by lane, into
  one int32 per output;
* attention (``attention.py``): lanes across a head's dims, or a block's keys.

Three kinds of vectors, lowered to LLVM vectors of those shapes:

* ``Bytes``: LANES × int8, a group vector;
* ``Ints``: PANEL × int32, one integer per output;
* ``Floats``: PANEL × float32.

The products: ``dot_unsigned`` takes unsigned weights (levels 0..63) against signed
activations, one ``vpdpbusd`` with VNNI, else ``maddubs`` + ``madd`` (which cannot saturate
for levels below 64). Signed weights (Q8_0) go through ``prepare_signed`` once per group and
``dot_prepared_signed`` per row: with VNNI, the weights shifted to unsigned (q + 128, whose
extra 128·Σa the caller takes off, ``SIGNED_OFFSET``); without, |q| against the activations
with q's sign. Either way the integers are exact, so every CPU gets the same sums.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from worker.engine.kernels import target_has
from worker.engine.kernels.simd import F32x8, Vector, address_of, call_intrinsic

WIDTH = 16 if target_has("avx512f", "avx512bw") else 8
PANEL = WIDTH  # outputs in a panel of the GEMM
LANES = 4 * PANEL
if PANEL == 16:
    HAS_VNNI = target_has("avx512vnni")
else:
    HAS_VNNI = target_has("avx512vnni", "avx512vl") or target_has("avxvnni")
SIGNED_OFFSET = 128 if HAS_VNNI else 0  # what prepare_signed adds to each weight

Bytes = Vector("i8", LANES)
Ints = Vector("i32", PANEL)
Floats = Vector("float", PANEL)
Shorts = Vector("i16", 2 * PANEL)

_I32 = ir.IntType(32)


def _splat(builder: ir.IRBuilder, scalar: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    """``scalar`` in every lane (integers truncated or sign-extended, floats narrowed)."""
    element = vector_type.element
    if isinstance(element, ir.IntType) and scalar.type.width != element.width:
        scalar = (builder.trunc if scalar.type.width > element.width else builder.sext)(scalar, element)
    elif isinstance(element, ir.FloatType) and scalar.type != element:
        scalar = builder.fptrunc(scalar, element)
    first = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, first, ir.Constant(ir.VectorType(_I32, vector_type.count),
                                                            [0] * vector_type.count))


def _load(context, builder, array_type, array, byte_offset, vector_type: ir.Type) -> ir.Value:
    address = address_of(context, builder, array_type, array, byte_offset)
    return builder.load(builder.bitcast(address, vector_type.as_pointer()), align=1)


# --- loads ---------------------------------------------------------------------------------------

@intrinsic
def load_bytes(typingctx, array, byte_offset):
    """LANES bytes of any contiguous array from ``byte_offset`` of its data."""
    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], Bytes.llvm_type())
    return Bytes(array, byte_offset), codegen


@intrinsic
def splat_quad(typingctx, array, byte_offset):
    """The four bytes at ``byte_offset`` in every 32-bit lane: an activation quad for every output."""
    def codegen(context, builder, sig, args):
        word = _load(context, builder, sig.args[0], args[0], args[1], _I32)
        return builder.bitcast(_splat(builder, word, Ints.llvm_type()), Bytes.llvm_type())
    return Bytes(array, byte_offset), codegen


@intrinsic
def load_halves(typingctx, array, byte_offset):
    """PANEL IEEE halves from ``byte_offset`` as floats."""
    def codegen(context, builder, sig, args):
        halves = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.HalfType(), PANEL))
        return builder.fpext(halves, Floats.llvm_type())
    return Floats(array, byte_offset), codegen


@intrinsic
def load_words(typingctx, array, byte_offset):
    """PANEL little-endian 32-bit words from ``byte_offset``."""
    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], Ints.llvm_type())
    return Ints(array, byte_offset), codegen


@intrinsic
def load_signed_bytes(typingctx, array, byte_offset):
    """PANEL signed bytes from ``byte_offset``, each widened to an int32 lane."""
    def codegen(context, builder, sig, args):
        small = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), PANEL))
        return builder.sext(small, Ints.llvm_type())
    return Ints(array, byte_offset), codegen


@intrinsic
def with_bit_set(typingctx, levels, array, byte_offset, value):
    """``levels`` with ``value`` added (or-ed) in each byte whose bit is set in the LANES bits
    at ``byte_offset`` (bit j, least significant first, for byte j)."""
    def codegen(context, builder, sig, args):
        bits = _load(context, builder, sig.args[1], args[1], args[2], ir.IntType(LANES))
        mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), LANES))
        lanes = Bytes.llvm_type()
        return builder.or_(args[0], builder.select(mask, _splat(builder, args[3], lanes), ir.Constant(lanes, None)))
    return Bytes(Bytes, array, byte_offset, value), codegen


# --- bytes ---------------------------------------------------------------------------------------

@intrinsic
def bits_of_bytes(typingctx, packed, shift, mask):
    """(byte >> shift) & mask in every byte, for 0 <= shift < 8 (shifted in 16-bit lanes: the
    mask must drop what the neighbouring byte shifts in)."""
    def codegen(context, builder, sig, args):
        words = builder.bitcast(args[0], Shorts.llvm_type())
        moved = builder.lshr(words, _splat(builder, args[1], Shorts.llvm_type()))
        return builder.and_(builder.bitcast(moved, Bytes.llvm_type()), _splat(builder, args[2], Bytes.llvm_type()))
    return Bytes(Bytes, shift, mask), codegen


@intrinsic
def shifted_up(typingctx, packed, shift, mask):
    """(byte << shift) & mask in every byte (16-bit lanes, as ``bits_of_bytes``)."""
    def codegen(context, builder, sig, args):
        words = builder.bitcast(args[0], Shorts.llvm_type())
        moved = builder.shl(words, _splat(builder, args[1], Shorts.llvm_type()))
        return builder.and_(builder.bitcast(moved, Bytes.llvm_type()), _splat(builder, args[2], Bytes.llvm_type()))
    return Bytes(Bytes, shift, mask), codegen


@intrinsic
def or_bytes(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.or_(args[0], args[1])
    return Bytes(Bytes, Bytes), codegen


# --- integer products ------------------------------------------------------------------------------

def _maddubs(builder, unsigned_bytes, signed_bytes):
    """Σ u·s over each four bytes without VNNI: pairs to saturating int16, then pairs of those."""
    if PANEL == 16:
        pairs = call_intrinsic(builder, "llvm.x86.avx512.pmaddubs.w.512", Shorts.llvm_type(), [unsigned_bytes, signed_bytes])
        ones = ir.Constant(Shorts.llvm_type(), [1] * 32)
        return call_intrinsic(builder, "llvm.x86.avx512.pmaddw.d.512", Ints.llvm_type(), [pairs, ones])
    pairs = call_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", Shorts.llvm_type(), [unsigned_bytes, signed_bytes])
    return call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", Ints.llvm_type(), [pairs, ir.Constant(Shorts.llvm_type(), [1] * 16)])


def _dot(builder, acc, unsigned_bytes, signed_bytes):
    lanes = Ints.llvm_type()
    if HAS_VNNI:
        name = "llvm.x86.avx512.vpdpbusd.512" if PANEL == 16 else "llvm.x86.avx512.vpdpbusd.256"
        return call_intrinsic(builder, name, lanes, [acc, builder.bitcast(unsigned_bytes, lanes),
                                            builder.bitcast(signed_bytes, lanes)])
    return builder.add(acc, _maddubs(builder, unsigned_bytes, signed_bytes))


@intrinsic
def dot_unsigned(typingctx, acc, weights, activations):
    """acc + Σ w·a over each lane's four bytes: w unsigned levels below 64, a signed."""
    def codegen(context, builder, sig, args):
        return _dot(builder, *args)
    return Ints(Ints, Bytes, Bytes), codegen


@intrinsic
def prepare_signed(typingctx, weights):
    """Signed weights made ready for ``dot_prepared_signed``: + 128 (as unsigned) with VNNI,
    unchanged without."""
    def codegen(context, builder, sig, args):
        if not HAS_VNNI:
            return args[0]
        return builder.xor(args[0], ir.Constant(Bytes.llvm_type(), [0x80] * LANES))
    return Bytes(Bytes), codegen


@intrinsic
def dot_prepared_signed(typingctx, acc, weights, activations):
    """acc + Σ (w + SIGNED_OFFSET)·a over each lane's four bytes, for weights from
    ``prepare_signed``."""
    def codegen(context, builder, sig, args):
        acc, weights, activations = args
        if HAS_VNNI:
            return _dot(builder, acc, weights, activations)
        lanes = Bytes.llvm_type()
        zero = ir.Constant(lanes, None)
        magnitude = call_intrinsic(builder, f"llvm.abs.v{LANES}i8", lanes, [weights, ir.Constant(ir.IntType(1), 0)])
        signed = builder.select(builder.icmp_signed("<", weights, zero), builder.sub(zero, activations), activations)
        return builder.add(acc, _maddubs(builder, magnitude, signed))
    return Ints(Ints, Bytes, Bytes), codegen


# --- integer lanes -------------------------------------------------------------------------------

@intrinsic
def zeros_int(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(Ints.llvm_type(), None)
    return Ints(), codegen


@intrinsic
def minus_splat(typingctx, a, value):
    """a - value in every lane."""
    def codegen(context, builder, sig, args):
        return builder.sub(args[0], _splat(builder, args[1], Ints.llvm_type()))
    return Ints(Ints, value), codegen


def _int_lanewise(build):
    @intrinsic
    def operation(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return build(builder, args[0], args[1])
        return Ints(Ints, Ints), codegen
    return operation


add_int = _int_lanewise(lambda builder, a, b: builder.add(a, b))
mul_int = _int_lanewise(lambda builder, a, b: builder.mul(a, b))
or_int = _int_lanewise(lambda builder, a, b: builder.or_(a, b))


@intrinsic
def field(typingctx, words, shift, mask):
    """(word >> shift) & mask in every lane."""
    def codegen(context, builder, sig, args):
        lanes = Ints.llvm_type()
        return builder.and_(builder.lshr(args[0], _splat(builder, args[1], lanes)), _splat(builder, args[2], lanes))
    return Ints(Ints, shift, mask), codegen


@intrinsic
def shifted_left(typingctx, words, shift):
    def codegen(context, builder, sig, args):
        return builder.shl(args[0], _splat(builder, args[1], Ints.llvm_type()))
    return Ints(Ints, shift), codegen


# --- float lanes ---------------------------------------------------------------------------------

@intrinsic
def zeros_float(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(Floats.llvm_type(), None)
    return Floats(), codegen


@intrinsic
def to_floats(typingctx, a):
    """Integer lanes as floats (exact below 2^24)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], Floats.llvm_type())
    return Floats(Ints), codegen


@intrinsic
def times_splat(typingctx, a, value):
    """a · value in every lane."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], _splat(builder, args[1], Floats.llvm_type()))
    return Floats(Floats, value), codegen


def _float_lanewise(build):
    @intrinsic
    def operation(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return build(builder, args[0], args[1])
        return Floats(Floats, Floats), codegen
    return operation


mul_float = _float_lanewise(lambda builder, a, b: builder.fmul(a, b))
add_float = _float_lanewise(lambda builder, a, b: builder.fadd(a, b))


@intrinsic
def fma_float(typingctx, a, b, c):
    """a · b + c, fused."""
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, f"llvm.fma.v{PANEL}f32", Floats.llvm_type(), list(args))
    return Floats(Floats, Floats, Floats), codegen


@intrinsic
def fma_splat(typingctx, a, value, c):
    """a · value + c, fused, with ``value`` in every lane."""
    def codegen(context, builder, sig, args):
        splat = _splat(builder, args[1], Floats.llvm_type())
        return call_intrinsic(builder, f"llvm.fma.v{PANEL}f32", Floats.llvm_type(), [args[0], splat, args[2]])
    return Floats(Floats, value, Floats), codegen


@intrinsic
def store_floats(typingctx, array, element_offset, value, count):
    """Write the first ``count`` lanes (at most PANEL) into a float32 array from element
    ``element_offset``; the other elements are not touched."""
    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), Floats.llvm_type().as_pointer())
        count = args[3]
        count = builder.trunc(count, _I32) if count.type.width > 32 else count
        index = ir.Constant(ir.VectorType(_I32, PANEL), list(range(PANEL)))
        mask = builder.icmp_signed("<", index, _splat(builder, count, ir.VectorType(_I32, PANEL)))
        call_intrinsic(builder, f"llvm.masked.store.v{PANEL}f32.p0", ir.VoidType(),
              [args[2], pointer, ir.Constant(_I32, 4), mask])
        return context.get_dummy_value()
    return types.none(array, element_offset, Floats, count), codegen


@intrinsic
def load_floats(typingctx, array, element_offset):
    """WIDTH float32 of a float32 array from element ``element_offset``."""
    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        return builder.load(builder.bitcast(builder.gep(data, [args[1]]), Floats.llvm_type().as_pointer()), align=4)
    return Floats(array, element_offset), codegen


@intrinsic
def put_floats(typingctx, array, element_offset, value):
    """Write WIDTH float32 into a float32 array from element ``element_offset``."""
    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        builder.store(args[2], builder.bitcast(builder.gep(data, [args[1]]), Floats.llvm_type().as_pointer()),
                      align=4)
        return context.get_dummy_value()
    return types.none(array, element_offset, Floats), codegen


@intrinsic
def load_widened(typingctx, array, element_offset, count):
    """WIDTH values of a float32 row, or of an f16 cache row (its bits as uint16), from element
    ``element_offset`` as floats; only the first ``count`` are read, the rest are 0."""
    half = array.dtype == types.uint16

    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        # halves move as 16-bit integers (a masked load of halves would be done one by one)
        element = ir.IntType(16) if half else ir.FloatType()
        vector = ir.VectorType(element, WIDTH)
        pointer = builder.bitcast(builder.gep(data, [args[1]]), vector.as_pointer())
        count = builder.trunc(args[2], _I32) if args[2].type.width > 32 else args[2]
        mask = builder.icmp_signed("<", ir.Constant(ir.VectorType(_I32, WIDTH), list(range(WIDTH))),
                                   _splat(builder, count, ir.VectorType(_I32, WIDTH)))
        loaded = call_intrinsic(builder, f"llvm.masked.load.v{WIDTH}{'i16' if half else 'f32'}.p0", vector,
                                [pointer, ir.Constant(_I32, 2 if half else 4), mask, ir.Constant(vector, None)])
        if half:
            loaded = builder.fpext(builder.bitcast(loaded, ir.VectorType(ir.HalfType(), WIDTH)), Floats.llvm_type())
        return loaded
    return Floats(array, element_offset, count), codegen


@intrinsic
def put_transposed(typingctx, out, out_at, out_stride, rows, rows_at, rows_stride, count, width):
    """A WIDTH × WIDTH block turned: row n of ``rows`` (float32, or f16 bits) from element
    ``rows_at + n · rows_stride``, its values l < ``width`` as floats, goes to ``out`` (float32)
    at element ``out_at + l · out_stride + n``. Rows n >= ``count`` and values l >= ``width``
    read as 0. The turn is log2(WIDTH) rounds of two-vector shuffles, each swapping the
    off-diagonal blocks of every pair of rows h apart (h = WIDTH/2, ..., 1)."""
    half = rows.dtype == types.uint16

    def codegen(context, builder, sig, args):
        source = cgutils.create_struct_proxy(sig.args[3])(context, builder, value=args[3]).data
        target = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        lane_index = ir.VectorType(_I32, WIDTH)
        element = ir.IntType(16) if half else ir.FloatType()
        vector = ir.VectorType(element, WIDTH)

        def narrow(value):
            return builder.trunc(value, _I32) if value.type.width > 32 else value
        count, width = narrow(args[6]), narrow(args[7])
        vectors = []
        for n in range(WIDTH):
            at = builder.add(args[4], builder.mul(args[5], ir.Constant(args[5].type, n)))
            present = builder.icmp_signed(">", count, ir.Constant(_I32, n))
            mask = builder.icmp_signed("<", ir.Constant(lane_index, list(range(WIDTH))),
                                       _splat(builder, builder.select(present, width, ir.Constant(_I32, 0)),
                                              lane_index))
            pointer = builder.bitcast(builder.gep(source, [at]), vector.as_pointer())
            loaded = call_intrinsic(builder, f"llvm.masked.load.v{WIDTH}{'i16' if half else 'f32'}.p0", vector,
                                    [pointer, ir.Constant(_I32, 2 if half else 4), mask, ir.Constant(vector, None)])
            if half:
                loaded = builder.fpext(builder.bitcast(loaded, ir.VectorType(ir.HalfType(), WIDTH)),
                                       Floats.llvm_type())
            vectors.append(loaded)
        h = WIDTH // 2
        while h:
            first = [lane if not lane & h else WIDTH + (lane ^ h) for lane in range(WIDTH)]
            second = [lane ^ h if not lane & h else WIDTH + lane for lane in range(WIDTH)]
            for a in range(WIDTH):
                if not a & h:
                    b = a + h
                    vectors[a], vectors[b] = (
                        builder.shuffle_vector(vectors[a], vectors[b], ir.Constant(lane_index, first)),
                        builder.shuffle_vector(vectors[a], vectors[b], ir.Constant(lane_index, second)))
            h //= 2
        for lane, value in enumerate(vectors):
            at = builder.add(args[1], builder.mul(args[2], ir.Constant(args[2].type, lane)))
            builder.store(value, builder.bitcast(builder.gep(target, [at]), Floats.llvm_type().as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(out, out_at, out_stride, rows, rows_at, rows_stride, count, width), codegen


@intrinsic
def load_widened_all(typingctx, array, element_offset):
    """``load_widened`` of a whole WIDTH values (a plain load, no mask)."""
    half = array.dtype == types.uint16

    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        element = ir.HalfType() if half else ir.FloatType()
        vector = ir.VectorType(element, WIDTH)
        pointer = builder.bitcast(builder.gep(data, [args[1]]), vector.as_pointer())
        loaded = builder.load(pointer, align=2 if half else 4)
        return builder.fpext(loaded, Floats.llvm_type()) if half else loaded
    return Floats(array, element_offset), codegen


@intrinsic
def splat_float(typingctx, value):
    def codegen(context, builder, sig, args):
        return _splat(builder, args[0], Floats.llvm_type())
    return Floats(value), codegen


sub_float = _float_lanewise(lambda builder, a, b: builder.fsub(a, b))
# the larger of a and b (b where either is NaN)
max_float = _float_lanewise(lambda builder, a, b: builder.select(builder.fcmp_ordered(">", a, b), a, b))


@intrinsic
def floor_floats(typingctx, a):
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, f"llvm.floor.v{WIDTH}f32", Floats.llvm_type(), [args[0]])
    return Floats(Floats), codegen


@intrinsic
def pow2_floats(typingctx, n):
    """2^n per lane for lanes holding whole numbers in -126..127 (n put in the exponent bits)."""
    def codegen(context, builder, sig, args):
        lanes = Ints.llvm_type()
        biased = builder.add(builder.fptosi(args[0], lanes), ir.Constant(lanes, [127] * WIDTH))
        return builder.bitcast(builder.shl(biased, ir.Constant(lanes, [23] * WIDTH)), Floats.llvm_type())
    return Floats(Floats), codegen


@intrinsic
def largest_lane(typingctx, a):
    """The largest lane (halves folded by max, then the rest)."""
    def codegen(context, builder, sig, args):
        value, width = args[0], WIDTH
        while width > 1:
            width //= 2
            index = ir.VectorType(_I32, width)
            low = builder.shuffle_vector(value, value, ir.Constant(index, list(range(width))))
            high = builder.shuffle_vector(value, value, ir.Constant(index, list(range(width, 2 * width))))
            value = builder.select(builder.fcmp_ordered(">", high, low), high, low)
        return builder.extract_element(value, ir.Constant(_I32, 0))
    return types.float32(Floats), codegen


@intrinsic
def keep_lanes(typingctx, a, first, lo, hi, fill):
    """a in the lanes l with lo <= first + l < hi, ``fill`` elsewhere (positions below 2^31)."""
    def codegen(context, builder, sig, args):
        index_type = ir.VectorType(_I32, WIDTH)

        def lanes_of(value):
            return _splat(builder, builder.trunc(value, _I32) if value.type.width > 32 else value, index_type)
        index = builder.add(lanes_of(args[1]), ir.Constant(index_type, list(range(WIDTH))))
        inside = builder.and_(builder.icmp_signed(">=", index, lanes_of(args[2])),
                              builder.icmp_signed("<", index, lanes_of(args[3])))
        return builder.select(inside, args[0], _splat(builder, args[4], Floats.llvm_type()))
    return Floats(Floats, first, lo, hi, fill), codegen


@intrinsic
def to_eight(typingctx, a):
    """The lanes as 8: lanes i and i + 8 added where WIDTH is 16."""
    def codegen(context, builder, sig, args):
        if WIDTH == 8:
            return args[0]
        index = ir.VectorType(_I32, 8)
        low = builder.shuffle_vector(args[0], args[0], ir.Constant(index, list(range(8))))
        high = builder.shuffle_vector(args[0], args[0], ir.Constant(index, list(range(8, 16))))
        return builder.fadd(low, high)
    return F32x8(Floats), codegen


# --- bfloat16, as the tile unit's float products read it ----------------------------------------

class _BFloat16(ir.Type):
    """LLVM's ``bfloat``: a float narrowed to it rounds to nearest, ties to even, which AVX-512's
    BF16 extension does in one instruction (``vcvtneps2bf16``) and LLVM in integer steps elsewhere."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat16)

    def __hash__(self):
        return hash("bfloat")


def _bf16_bits(builder: ir.IRBuilder, floats: ir.Value) -> ir.Value:
    """Each lane of a float vector rounded to bfloat16, as 16-bit integers."""
    count = floats.type.count
    return builder.bitcast(builder.fptrunc(floats, ir.VectorType(_BFloat16(), count)), ir.VectorType(ir.IntType(16), count))


def _u16_pointer(context, builder, array_type, array, element_offset, vector: ir.Type) -> ir.Value:
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [element_offset]), vector.as_pointer())


@intrinsic
def put_bf16(typingctx, array, element_offset, value):
    """WIDTH floats rounded to bfloat16 into a uint16 array from element ``element_offset``."""
    def codegen(context, builder, sig, args):
        halves = _bf16_bits(builder, args[2])
        builder.store(halves, _u16_pointer(context, builder, sig.args[0], args[0], args[1], halves.type), align=2)
        return context.get_dummy_value()
    return types.none(array, element_offset, Floats), codegen


@intrinsic
def put_bf16_pairs(typingctx, array, element_offset, low, high):
    """WIDTH pairs of bfloat16 into a uint16 array from element ``element_offset``: lane i's
    ``low`` then its ``high``, each rounded, side by side (the pairs a tile product's B rows
    hold: two consecutive values of its inner dimension for one output)."""
    def codegen(context, builder, sig, args):
        order = [i // 2 + (i % 2) * WIDTH for i in range(2 * WIDTH)]
        pairs = builder.shuffle_vector(args[2], args[3], ir.Constant(ir.VectorType(_I32, 2 * WIDTH), order))
        halves = _bf16_bits(builder, pairs)
        builder.store(halves, _u16_pointer(context, builder, sig.args[0], args[0], args[1], halves.type), align=2)
        return context.get_dummy_value()
    return types.none(array, element_offset, Floats, Floats), codegen


@intrinsic
def nearest_floats(typingctx, a):
    """Each lane rounded to the nearest whole number, ties to even (one ``vrndscaleps``)."""
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, f"llvm.roundeven.v{WIDTH}f32", Floats.llvm_type(), [args[0]])
    return Floats(Floats), codegen


@intrinsic
def scaled_by_pow2(typingctx, a, n):
    """a · 2^n per lane for whole numbers n of any size (0 below float32's range): AVX-512's
    ``vscalefps``, which only the 512-bit kernels (the tile unit's attention) use."""
    if WIDTH != 16:
        raise TypingError("scaled_by_pow2 needs AVX-512")

    def codegen(context, builder, sig, args):
        floats = Floats.llvm_type()
        return call_intrinsic(builder, "llvm.x86.avx512.mask.scalef.ps.512", floats,
                              [args[0], args[1], ir.Constant(floats, ir.Undefined),
                               ir.Constant(ir.IntType(16), -1), ir.Constant(_I32, 4)])
    return Floats(Floats, Floats), codegen
