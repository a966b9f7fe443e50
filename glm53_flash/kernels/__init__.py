"""Triton device functions by task family (gemv, mhc, kda, mlp, moe, indexer, mla, sample).

Importing this package under TRITON_INTERPRET=1 also makes the interpreter round fp32 -> bf16 casts to
nearest even, as the GPU does: triton 3.6's interpreter truncates them (`.to(tl.bfloat16)` passes no
rounding mode to its numpy conversion), which doubled the bf16 hand-off error of the CPU runs
(end-to-end logits 1.1e-2 relative instead of ~5e-3) and made CPU and GPU numerics differ.
"""
import numpy as np
import triton


def _rne_bf16_bits(x) -> np.ndarray:
    """fp32 array -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = np.where(np.isnan(f), (u >> 16) | 0x40, r)
    return r.astype(np.uint16)


def _patch_interpreter_bf16_rounding() -> None:
    if not triton.knobs.runtime.interpret:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp
    builder = interp.InterpreterBuilder
    if getattr(builder, "_glm53_bf16_rne", False):
        return
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def _is_f32_to_bf16(src, dst_type) -> bool:
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    def patched_cast(self, src, dst_type):
        if _is_f32_to_bf16(src, dst_type):
            return interp.TensorHandle(_rne_bf16_bits(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if _is_f32_to_bf16(src, dst_type):   # rtne, the only mode our kernels use for bf16
            return interp.TensorHandle(_rne_bf16_bits(src.data), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = patched_cast
    builder.create_fp_to_fp = patched_fp_to_fp
    builder._glm53_bf16_rne = True


_patch_interpreter_bf16_rounding()
