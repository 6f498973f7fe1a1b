"""Short SIMD vectors for numba kernels: 256-bit types and the AVX2 operations on them.

numba has no vector types, so this module declares four (32 × int8, 16 × int16, 8 × int32 and
8 × float32), each lowered to the LLVM vector type of the same shape, and the handful of
operations the block-quantized dot products need. Kernels written with them read like their
C counterparts while staying Python; LLVM keeps the values in registers.

The integer product is ``dot_bytes``: 32 unsigned bytes × 32 signed bytes → 8 int32 sums of
four. On CPUs with VNNI (AVX512-VNNI with AVX512-VL, or AVX-VNNI) it is one ``vpdpbusd``; on
the others the two AVX2 multiply-adds every int8 dot product on x86 is otherwise built from,
``maddubs`` (→ 16 saturating int16 pair sums) and ``madd`` (→ 8 int32 pair sums). Which one is
decided when a kernel compiles, for the CPU it compiles on (numba's disk cache is keyed by the
CPU), and both give the same integers wherever ``maddubs`` cannot saturate, which holds for every
block type here. Callers must only compile these kernels where the CPU has AVX2 (see
``kernels.available``): elsewhere the engine takes its portable path.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from worker.engine.kernels import target_has


class Vector(types.Type):
    """A vector of ``lanes`` elements of ``element`` (an LLVM type name); 256 bits here, wider in
    ``wide_simd.py``."""

    def __init__(self, element: str, lanes: int):
        self.element = element
        self.lanes = lanes
        super().__init__(name=f"vector<{lanes} x {element}>")

    def llvm_type(self) -> ir.VectorType:
        element = ir.FloatType() if self.element == "float" else ir.IntType(int(self.element[1:]))
        return ir.VectorType(element, self.lanes)


I8x32 = Vector("i8", 32)
I16x16 = Vector("i16", 16)
I32x8 = Vector("i32", 8)
F32x8 = Vector("float", 8)


@register_model(Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.llvm_type())


def call_intrinsic(builder: ir.IRBuilder, name: str, result: ir.Type, args: list) -> ir.Value:
    """Call an LLVM intrinsic (declared on first use in the module)."""
    module = builder.module
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(result, [a.type for a in args]), name=name)
    return builder.call(fn, args)


def _broadcast(builder: ir.IRBuilder, scalar: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    """``scalar`` (an integer of any width, or a float) in every lane of ``vector_type``."""
    element = vector_type.element
    if isinstance(element, ir.IntType) and scalar.type.width != element.width:
        scalar = (builder.trunc if scalar.type.width > element.width else builder.sext)(scalar, element)
    elif isinstance(element, ir.FloatType) and scalar.type != element:
        scalar = builder.fptrunc(scalar, element)
    first = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    lanes = ir.Constant(ir.VectorType(ir.IntType(32), vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(first, first, lanes)


def address_of(context, builder, array_type, array, byte_offset):
    """An i8* to byte ``byte_offset`` of a contiguous array's data."""
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    raw = builder.bitcast(data, ir.IntType(8).as_pointer())
    return builder.gep(raw, [byte_offset])


def _load(builder, address, vector_type: ir.Type) -> ir.Value:
    return builder.load(builder.bitcast(address, vector_type.as_pointer()), align=1)


# --- loads ------------------------------------------------------------------------------------

@intrinsic
def load_i8x32(typingctx, array, byte_offset):
    """32 bytes of ``array`` from ``byte_offset`` (no alignment needed)."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        return _load(builder, address, I8x32.llvm_type())
    return I8x32(array, byte_offset), codegen


@intrinsic
def load_i8x16_nibbles(typingctx, array, byte_offset):
    """16 bytes holding 32 four-bit values → 32 bytes 0..15: the low nibbles of the 16 bytes
    first, then their high nibbles (the order of GGML's 4-bit blocks)."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        low16 = _load(builder, address, ir.VectorType(ir.IntType(8), 16))
        # the high nibbles shifted down four bits, in 16-bit lanes (x86 has no byte shift)
        words = builder.bitcast(low16, ir.VectorType(ir.IntType(16), 8))
        high16 = builder.bitcast(builder.lshr(words, ir.Constant(words.type, [4] * 8)), low16.type)
        both = builder.shuffle_vector(low16, high16, ir.Constant(ir.VectorType(ir.IntType(32), 32),
                                                                 list(range(32))))
        return builder.and_(both, ir.Constant(both.type, [0x0F] * 32))
    return I8x32(array, byte_offset), codegen


@intrinsic
def load_i8x8_crumbs(typingctx, array, byte_offset):
    """8 bytes holding 32 two-bit values → 32 bytes 0..3: value j from bits 2·(j % 4) of byte
    j // 4 (the order of Q2_0's blocks)."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        packed = _load(builder, address, ir.VectorType(ir.IntType(8), 8))
        eight = ir.VectorType(ir.IntType(8), 8)
        # crumb k of every byte, each in its own vector of 8 lanes
        crumbs = [builder.and_(builder.lshr(packed, ir.Constant(eight, [2 * k] * 8)), ir.Constant(eight, [3] * 8))
                  for k in range(4)]
        sixteen = ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(16)))
        low, high = (builder.shuffle_vector(crumbs[i], crumbs[i + 1], sixteen) for i in (0, 2))
        order = [(k // 2) * 16 + (k % 2) * 8 + j // 4 for j in range(32) for k in [j % 4]]
        return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), 32), order))
    return I8x32(array, byte_offset), codegen


@intrinsic
def load_f16(typingctx, array, byte_offset):
    """The IEEE half at ``byte_offset`` of ``array`` as a float32."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        half = builder.load(builder.bitcast(address, ir.HalfType().as_pointer()), align=1)
        return builder.fpext(half, ir.FloatType())
    return types.float32(array, byte_offset), codegen


@intrinsic
def load_f32(typingctx, array, byte_offset):
    """The float32 at ``byte_offset`` of any contiguous array's data."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        return builder.load(builder.bitcast(address, ir.FloatType().as_pointer()), align=1)
    return types.float32(array, byte_offset), codegen


@intrinsic
def load_bf16(typingctx, array, byte_offset):
    """The bfloat16 at ``byte_offset`` as a float32 (its bits are a float32's high half)."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        bits = builder.zext(builder.load(builder.bitcast(address, ir.IntType(16).as_pointer()), align=1),
                            ir.IntType(32))
        return builder.bitcast(builder.shl(bits, ir.Constant(ir.IntType(32), 16)), ir.FloatType())
    return types.float32(array, byte_offset), codegen


@intrinsic
def load_f32x8(typingctx, array, element_offset):
    """8 float32 of a float32 array from element ``element_offset``."""
    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), F32x8.llvm_type().as_pointer())
        return builder.load(address, align=4)
    return F32x8(array, element_offset), codegen


@intrinsic
def store_f32x8(typingctx, array, element_offset, value):
    """Write 8 float32 into a float32 array from element ``element_offset``."""
    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), F32x8.llvm_type().as_pointer())
        builder.store(args[2], address, align=4)
        return context.get_dummy_value()
    return types.none(array, element_offset, F32x8), codegen


def _kv_pointer(context, builder, array_type, array, element_offset, vector_type):
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [element_offset]), vector_type.as_pointer())


@intrinsic
def load_kv8(typingctx, array, element_offset):
    """8 values of a KV cache row from element ``element_offset`` as 8 float32: the row is
    float32, or uint16 holding IEEE halves (an f16 cache)."""
    half = array.dtype == types.uint16

    def codegen(context, builder, sig, args):
        if half:
            vector = ir.VectorType(ir.HalfType(), 8)
            halves = builder.load(_kv_pointer(context, builder, sig.args[0], args[0], args[1], vector), align=2)
            return builder.fpext(halves, F32x8.llvm_type())
        return builder.load(_kv_pointer(context, builder, sig.args[0], args[0], args[1], F32x8.llvm_type()), align=4)
    return F32x8(array, element_offset), codegen


@intrinsic
def store_kv8(typingctx, array, element_offset, value):
    """Write 8 float32 into a KV cache row from element ``element_offset``, rounded to the
    nearest half when the row is uint16 (an f16 cache)."""
    half = array.dtype == types.uint16

    def codegen(context, builder, sig, args):
        if half:
            vector = ir.VectorType(ir.HalfType(), 8)
            builder.store(builder.fptrunc(args[2], vector),
                          _kv_pointer(context, builder, sig.args[0], args[0], args[1], vector), align=2)
        else:
            builder.store(args[2], _kv_pointer(context, builder, sig.args[0], args[0], args[1], F32x8.llvm_type()),
                          align=4)
        return context.get_dummy_value()
    return types.none(array, element_offset, F32x8), codegen


@intrinsic
def store_kv8_apart(typingctx, array, element_offset, stride, value):
    """Write 8 float32 into a KV cache array ``stride`` elements apart from element
    ``element_offset`` (value i at offset + i·stride), rounded to the nearest half when the
    array is uint16 (an f16 cache): one key's dims into a run of the key cache."""
    half = array.dtype == types.uint16

    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        values = builder.fptrunc(args[3], ir.VectorType(ir.HalfType(), 8)) if half else args[3]
        element = ir.HalfType() if half else ir.FloatType()
        base = builder.bitcast(data, element.as_pointer())
        for i in range(8):
            at = builder.add(args[1], builder.mul(args[2], ir.Constant(args[2].type, i)))
            builder.store(builder.extract_element(values, ir.Constant(ir.IntType(32), i)), builder.gep(base, [at]))
        return context.get_dummy_value()
    return types.none(array, element_offset, stride, F32x8), codegen


@intrinsic
def load_f32x8_at(typingctx, array, byte_offset):
    """8 float32 from ``byte_offset`` of a byte array."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        return _load(builder, address, F32x8.llvm_type())
    return F32x8(array, byte_offset), codegen


@intrinsic
def load_f16x8(typingctx, array, byte_offset):
    """8 IEEE halves from ``byte_offset`` as 8 float32."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        halves = _load(builder, address, ir.VectorType(ir.HalfType(), 8))
        return builder.fpext(halves, F32x8.llvm_type())
    return F32x8(array, byte_offset), codegen


@intrinsic
def load_bf16x8(typingctx, array, byte_offset):
    """8 bfloat16 from ``byte_offset`` as 8 float32 (a bfloat16 is a float32's high half)."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        words = _load(builder, address, ir.VectorType(ir.IntType(16), 8))
        wide = builder.zext(words, I32x8.llvm_type())
        shifted = builder.shl(wide, ir.Constant(wide.type, [16] * 8))
        return builder.bitcast(shifted, F32x8.llvm_type())
    return F32x8(array, byte_offset), codegen


# --- integer products -------------------------------------------------------------------------

HAS_VNNI = target_has("avx512vnni", "avx512vl") or target_has("avxvnni")


@intrinsic
def dot_bytes(typingctx, unsigned_bytes, signed_bytes, pair_scales):
    """Σ u·s over each four consecutive bytes → 8 int32, lane j times ``pair_scales``' lane 2j.

    ``pair_scales`` (16 int16, as ``madd`` takes them) must come in equal pairs, as
    ``splat_i16`` and ``pair_scales_i16`` make them; a constant one costs nothing."""
    def codegen(context, builder, sig, args):
        u, s, scales = args
        if not HAS_VNNI:
            pairs = call_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", I16x16.llvm_type(), [u, s])
            return call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", I32x8.llvm_type(), [pairs, scales])
        lanes = I32x8.llvm_type()
        sums = call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", lanes,
                     [ir.Constant(lanes, [0] * 8), builder.bitcast(u, lanes), builder.bitcast(s, lanes)])
        even = builder.shuffle_vector(scales, scales, ir.Constant(ir.VectorType(ir.IntType(32), 8),
                                                                  list(range(0, 16, 2))))
        return builder.mul(sums, builder.sext(even, lanes))
    return I32x8(I8x32, I8x32, I16x16), codegen


@intrinsic
def sign_bytes(typingctx, a, b):
    """a with each byte negated where b's is negative and zeroed where b's is zero."""
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.x86.avx2.psign.b", I8x32.llvm_type(), list(args))
    return I8x32(I8x32, I8x32), codegen


@intrinsic
def abs_bytes(typingctx, a):
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.abs.v32i8", I8x32.llvm_type(), [args[0], ir.Constant(ir.IntType(1), 0)])
    return I8x32(I8x32), codegen


@intrinsic
def sub_bytes(typingctx, a, b):
    """a - b per byte (wrapping)."""
    def codegen(context, builder, sig, args):
        return builder.sub(args[0], args[1])
    return I8x32(I8x32, I8x32), codegen


@intrinsic
def or_bytes(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.or_(args[0], args[1])
    return I8x32(I8x32, I8x32), codegen


def _byte_constant(value) -> ir.Constant:
    return ir.Constant(I8x32.llvm_type(), [value] * 32)


@intrinsic
def low_nibbles(typingctx, a):
    """The low four bits of each byte."""
    def codegen(context, builder, sig, args):
        return builder.and_(args[0], _byte_constant(0x0F))
    return I8x32(I8x32), codegen


@intrinsic
def shifted_bits(typingctx, a, shift, mask):
    """(a >> shift) & mask per byte for shift >= 0, (a << -shift) & mask for shift < 0; the mask
    must drop the bits a 16-bit shift carries over from the neighbouring byte."""
    def codegen(context, builder, sig, args):
        words = builder.bitcast(args[0], I16x16.llvm_type())
        amounts = _broadcast(builder, args[1], I16x16.llvm_type())
        negative = builder.icmp_signed("<", args[1], ir.Constant(args[1].type, 0))
        right = builder.lshr(words, amounts)
        left = builder.shl(words, builder.sub(ir.Constant(words.type, [0] * 16), amounts))
        moved = builder.bitcast(builder.select(negative, left, right), I8x32.llvm_type())
        return builder.and_(moved, _broadcast(builder, args[2], I8x32.llvm_type()))
    return I8x32(I8x32, shift, mask), codegen


@intrinsic
def where_bits(typingctx, a, bit, value):
    """``value`` in each byte of a whose ``bit`` (a mask) is set, else 0."""
    def codegen(context, builder, sig, args):
        lanes = I8x32.llvm_type()
        bits = _broadcast(builder, args[1], lanes)
        is_set = builder.icmp_unsigned("!=", builder.and_(args[0], bits), ir.Constant(lanes, [0] * 32))
        return builder.select(is_set, _broadcast(builder, args[2], lanes), ir.Constant(lanes, [0] * 32))
    return I8x32(I8x32, bit, value), codegen


@intrinsic
def bits_as_bytes(typingctx, word, value):
    """``value`` in byte j where bit j of the low 32 bits of ``word`` is set, else 0."""
    def codegen(context, builder, sig, args):
        lanes = I8x32.llvm_type()
        bits = builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.VectorType(ir.IntType(1), 32))
        return builder.select(bits, _broadcast(builder, args[1], lanes), ir.Constant(lanes, [0] * 32))
    return I8x32(word, value), codegen


@intrinsic
def splat_i16(typingctx, value):
    """16 copies of an integer (as int16)."""
    def codegen(context, builder, sig, args):
        return _broadcast(builder, args[0], I16x16.llvm_type())
    return I16x16(value), codegen


@intrinsic
def splat_i8(typingctx, value):
    """32 copies of an integer (as a byte)."""
    def codegen(context, builder, sig, args):
        return _broadcast(builder, args[0], I8x32.llvm_type())
    return I8x32(value), codegen


@intrinsic
def pair_scales_i16(typingctx, low, high):
    """16 int16: ``low`` in the lanes of bytes 0..15 of a 32-byte product, ``high`` in those of
    bytes 16..31 (for blocks whose 16-value halves carry their own scales)."""
    def codegen(context, builder, sig, args):
        lanes = I16x16.llvm_type()
        vector = ir.Constant(lanes, ir.Undefined)
        values = [builder.trunc(a, ir.IntType(16)) if a.type.width > 16 else
                  builder.sext(a, ir.IntType(16)) if a.type.width < 16 else a for a in args]
        for lane in range(16):
            vector = builder.insert_element(vector, values[lane // 8], ir.Constant(ir.IntType(32), lane))
        return vector
    return I16x16(low, high), codegen



@intrinsic
def load_u32(typingctx, array, byte_offset):
    """The little-endian uint32 at ``byte_offset`` of a byte array (no alignment needed), as uint64."""
    def codegen(context, builder, sig, args):
        address = address_of(context, builder, sig.args[0], args[0], args[1])
        word = builder.load(builder.bitcast(address, ir.IntType(32).as_pointer()), align=1)
        return builder.zext(word, ir.IntType(64))
    return types.uint64(array, byte_offset), codegen


@intrinsic
def bytes_f32(typingctx, word):
    """The eight bytes of a 64-bit word, lowest first, as 8 float32 (0..255)."""
    def codegen(context, builder, sig, args):
        as_bytes = builder.bitcast(args[0], ir.VectorType(ir.IntType(8), 8))
        return builder.uitofp(builder.zext(as_bytes, ir.VectorType(ir.IntType(32), 8)), F32x8.llvm_type())
    return F32x8(types.uint64), codegen

# --- float lanes --------------------------------------------------------------------------------

@intrinsic
def zeros_f32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(F32x8.llvm_type(), [0.0] * 8)
    return F32x8(), codegen


@intrinsic
def splat_f32(typingctx, value):
    """8 copies of a float."""
    def codegen(context, builder, sig, args):
        return _broadcast(builder, args[0], F32x8.llvm_type())
    return F32x8(value), codegen


@intrinsic
def to_f32(typingctx, a):
    """8 int32 → 8 float32."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], F32x8.llvm_type())
    return F32x8(I32x8), codegen


@intrinsic
def fmadd(typingctx, a, b, c):
    """a * b + c, fused."""
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.fma.v8f32", F32x8.llvm_type(), list(args))
    return F32x8(F32x8, F32x8, F32x8), codegen


@intrinsic
def sum_f32(typingctx, a):
    """The sum of the 8 lanes."""
    def codegen(context, builder, sig, args):
        total = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
        for lane in range(1, 8):
            total = builder.fadd(total, builder.extract_element(args[0], ir.Constant(ir.IntType(32), lane)))
        return total
    return types.float32(F32x8), codegen


def _lanewise(build):
    """An intrinsic applying ``build(builder, a, b)`` to two F32x8, lane by lane."""
    @intrinsic
    def operation(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return build(builder, args[0], args[1])
        return F32x8(F32x8, F32x8), codegen
    return operation


add_f32 = _lanewise(lambda builder, a, b: builder.fadd(a, b))
sub_f32 = _lanewise(lambda builder, a, b: builder.fsub(a, b))
mul_f32 = _lanewise(lambda builder, a, b: builder.fmul(a, b))
div_f32 = _lanewise(lambda builder, a, b: builder.fdiv(a, b))
# the larger of a and b (b where either is NaN)
max_f32 = _lanewise(lambda builder, a, b: builder.select(builder.fcmp_ordered(">", a, b), a, b))


@intrinsic
def sum_pairs_f32(typingctx, a):
    """The sum of the 8 lanes as ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)): independent adds."""
    def codegen(context, builder, sig, args):
        lane = [builder.extract_element(args[0], ir.Constant(ir.IntType(32), i)) for i in range(8)]
        quads = [builder.fadd(builder.fadd(lane[i], lane[i + 1]), builder.fadd(lane[i + 2], lane[i + 3]))
                 for i in (0, 4)]
        return builder.fadd(quads[0], quads[1])
    return types.float32(F32x8), codegen


@intrinsic
def sums8_f32(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """The lane sums of eight vectors as one vector, each added as ``sum_pairs_f32`` adds."""
    def codegen(context, builder, sig, args):
        def hadd(x, y):
            return call_intrinsic(builder, "llvm.x86.avx.hadd.ps.256", F32x8.llvm_type(), [x, y])
        quad_low = hadd(hadd(args[0], args[1]), hadd(args[2], args[3]))
        quad_high = hadd(hadd(args[4], args[5]), hadd(args[6], args[7]))
        return _join_halves(builder, quad_low, quad_high, builder.fadd)
    return F32x8(F32x8, F32x8, F32x8, F32x8, F32x8, F32x8, F32x8, F32x8), codegen


def _join_halves(builder, quad_low, quad_high, add):
    """The last step of eight vectors' lane sums by horizontal adds: ``quad_low`` (from v0..v3)
    holds their low-half sums in its low half and their high-half sums in its high half, as
    ``quad_high`` does for v4..v7; lane j of the result is the sum of all of vj's lanes."""
    index = ir.VectorType(ir.IntType(32), 8)
    low = builder.shuffle_vector(quad_low, quad_high, ir.Constant(index, [0, 1, 2, 3, 8, 9, 10, 11]))
    high = builder.shuffle_vector(quad_low, quad_high, ir.Constant(index, [4, 5, 6, 7, 12, 13, 14, 15]))
    return add(low, high)


@intrinsic
def hadd_i32(typingctx, a, b):
    """Adjacent lane pairs of a and b, per 128-bit half: (a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, ...)."""
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.x86.avx2.phadd.d", I32x8.llvm_type(), list(args))
    return I32x8(I32x8, I32x8), codegen


@intrinsic
def join_halves_i32(typingctx, quad_low, quad_high):
    """``_join_halves`` for int32: quad_low = hadd(hadd(v0, v1), hadd(v2, v3)), quad_high the same
    of v4..v7; lane j of the result is the sum of all of vj's lanes."""
    def codegen(context, builder, sig, args):
        return _join_halves(builder, args[0], args[1], builder.add)
    return I32x8(I32x8, I32x8), codegen


# --- float lanes the loop vectorizer leaves scalar ------------------------------------------------
# numba lowers max() and np.floor so that LLVM does not vectorize loops holding them; kernels
# that need them across a row write the lanes out with these.

@intrinsic
def max_lane_f32(typingctx, a):
    """The largest of the 8 lanes."""
    def codegen(context, builder, sig, args):
        best = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
        for lane in range(1, 8):
            value = builder.extract_element(args[0], ir.Constant(ir.IntType(32), lane))
            best = builder.select(builder.fcmp_ordered(">", value, best), value, best)
        return best
    return types.float32(F32x8), codegen


@intrinsic
def floor_f32(typingctx, a):
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.floor.v8f32", F32x8.llvm_type(), [args[0]])
    return F32x8(F32x8), codegen


@intrinsic
def pow2_f32(typingctx, n):
    """2^n per lane for lanes holding whole numbers in -126..127 (n put in the exponent bits)."""
    def codegen(context, builder, sig, args):
        lanes = I32x8.llvm_type()
        whole = builder.fptosi(args[0], lanes)
        biased = builder.add(whole, ir.Constant(lanes, [127] * 8))
        return builder.bitcast(builder.shl(biased, ir.Constant(lanes, [23] * 8)), F32x8.llvm_type())
    return F32x8(F32x8), codegen


@intrinsic
def abs_f32(typingctx, a):
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.fabs.v8f32", F32x8.llvm_type(), [args[0]])
    return F32x8(F32x8), codegen


@intrinsic
def where_nonnegative_f32(typingctx, test, a, b):
    """a in the lanes where ``test`` >= 0, b elsewhere."""
    def codegen(context, builder, sig, args):
        zero = ir.Constant(F32x8.llvm_type(), [0.0] * 8)
        return builder.select(builder.fcmp_ordered(">=", args[0], zero), args[1], args[2])
    return F32x8(F32x8, F32x8, F32x8), codegen


@intrinsic
def keep_lanes_f32(typingctx, a, first, lo, hi, fill):
    """a in the lanes l with lo <= first + l < hi, ``fill`` elsewhere."""
    def codegen(context, builder, sig, args):
        index_type = ir.VectorType(ir.IntType(64), 8)

        def wide(value):
            value = builder.sext(value, ir.IntType(64)) if value.type.width < 64 else value
            return _broadcast(builder, value, index_type)
        index = builder.add(wide(args[1]), ir.Constant(index_type, list(range(8))))
        inside = builder.and_(builder.icmp_signed(">=", index, wide(args[2])),
                              builder.icmp_signed("<", index, wide(args[3])))
        return builder.select(inside, args[0], _broadcast(builder, args[4], F32x8.llvm_type()))
    return F32x8(F32x8, first, lo, hi, fill), codegen


@intrinsic
def rint_f32(typingctx, a):
    """Each lane rounded to the nearest whole number, halves to even (as np.rint)."""
    def codegen(context, builder, sig, args):
        return call_intrinsic(builder, "llvm.rint.v8f32", F32x8.llvm_type(), [args[0]])
    return F32x8(F32x8), codegen


@intrinsic
def store_i8x8(typingctx, array, element_offset, value):
    """Write 8 float lanes holding whole numbers in -128..127 into an int8 array as bytes."""
    def codegen(context, builder, sig, args):
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        vector = ir.VectorType(ir.IntType(8), 8)
        address = builder.bitcast(builder.gep(data, [args[1]]), vector.as_pointer())
        builder.store(builder.trunc(builder.fptosi(args[2], I32x8.llvm_type()), vector), address, align=1)
        return context.get_dummy_value()
    return types.none(array, element_offset, F32x8), codegen
