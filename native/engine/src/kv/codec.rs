//! Row codecs: one head row of keys or values in the cache's storage type (f32, f16, or
//! llama.cpp's q8_0 / q4_0 blocks) written from and read back into f32.

use super::{KvType, QK};
use half::f16;

/// One head row `src` into `dst`, exactly the bytes the row takes in `kv_type`
/// ([`KvType::bytes`] of its length), at an offset aligned for the type's elements.
pub(super) fn write_row(kv_type: KvType, dst: &mut [u8], src: &[f32]) {
    debug_assert_eq!(dst.len(), kv_type.bytes(src.len()));
    match kv_type {
        KvType::F32 => {
            debug_assert!(dst.as_ptr().cast::<u32>().is_aligned());
            // SAFETY: `dst` holds `src.len()` words at an aligned address (a row starts at a
            // whole element of the cache's u32 storage); every bit pattern is a valid f32.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<f32>(), src.len())
            };
            dst.copy_from_slice(src);
        }
        KvType::F16 => {
            debug_assert!(dst.as_ptr().cast::<u16>().is_aligned());
            // SAFETY: as for f32, with halves.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<f16>(), src.len())
            };
            half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
        }
        KvType::Q8_0 | KvType::Q4_0 => {
            let bb = kv_type.bytes(QK);
            for (x, dst) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(bb)) {
                if kv_type == KvType::Q8_0 {
                    quantize_q8_0(x, dst);
                } else {
                    quantize_q4_0(x, dst);
                }
            }
        }
    }
}

/// One q8_0 block: the kernels' activation quantizer (llama.cpp's `quantize_row_q8_0`, ties
/// to even), its scale stored as f16.
fn quantize_q8_0(x: &[f32], dst: &mut [u8]) {
    let (head, q) = dst.split_at_mut(2);
    // SAFETY: i8 and u8 have the same size and alignment.
    let q: &mut [i8] = unsafe { &mut *(q as *mut [u8] as *mut [i8]) };
    let d = crate::kernels::q8::quantize_block_q8_0(x, &mut q[..QK]);
    head.copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
}

/// ggml's `quantize_row_q4_0_ref`: `d = max / -8` (the value of largest magnitude, signed),
/// `q = min(15, x / d + 8.5)`; byte `j` holds values `j` (low nibble) and `j + 16`.
fn quantize_q4_0(x: &[f32], dst: &mut [u8]) {
    let max = x
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    dst[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    let q = |v: f32| ((v * id + 8.5) as u8).min(15);
    for j in 0..QK / 2 {
        dst[2 + j] = q(x[j]) | (q(x[j + QK / 2]) << 4);
    }
}

pub(super) fn read_rows(kv_type: KvType, words: &[u32], at: usize, out: &mut [f32]) {
    match kv_type {
        KvType::F32 => {
            let n = out.len();
            for (o, w) in out.iter_mut().zip(&words[at..at + n]) {
                *o = f32::from_bits(*w);
            }
        }
        KvType::F16 => {
            let halves: &[u16] = bytemuck_u16(words);
            f16_to_f32(&halves[at..at + out.len()], out);
        }
        // dequantized a head row at a time, into the attention's chunk buffer: the cache
        // itself stays quantized
        KvType::Q8_0 | KvType::Q4_0 => {
            let bytes = bytemuck_u8(words);
            let (bb, mut off) = (kv_type.bytes(QK), kv_type.bytes(at));
            let simd = crate::kernels::has_avx2();
            for o in out.chunks_exact_mut(QK) {
                let blk = &bytes[off..off + bb];
                let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
                let q = &blk[2..];
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: AVX2 was detected; `q` holds 32 (q8_0) or 16 (q4_0) bytes and
                    // `o` 32 values.
                    unsafe {
                        if kv_type == KvType::Q8_0 {
                            dequant_q8_0_avx2(d, q, o)
                        } else {
                            dequant_q4_0_avx2(d, q, o)
                        }
                    }
                    off += bb;
                    continue;
                }
                let _ = simd;
                if kv_type == KvType::Q8_0 {
                    for (y, &q) in o.iter_mut().zip(q) {
                        *y = d * (q as i8) as f32;
                    }
                } else {
                    for j in 0..QK / 2 {
                        o[j] = d * ((q[j] & 0x0f) as i32 - 8) as f32;
                        o[j + QK / 2] = d * ((q[j] >> 4) as i32 - 8) as f32;
                    }
                }
                off += bb;
            }
        }
    }
}

/// 32 q8_0 values `d · q` into `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequant_q8_0_avx2(d: f32, q: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let scale = _mm256_set1_ps(d);
    for k in 0..4 {
        let bytes = _mm_loadl_epi64(q.as_ptr().add(8 * k) as *const __m128i);
        let ints = _mm256_cvtepi8_epi32(bytes);
        let v = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(ints));
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * k), v);
    }
}

/// 32 q4_0 values `d · (nibble - 8)` into `out` (low nibbles first, then high ones).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequant_q4_0_avx2(d: f32, q: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let scale = _mm256_set1_ps(d);
    let packed = _mm_loadu_si128(q.as_ptr() as *const __m128i);
    let mask = _mm_set1_epi8(0x0f);
    let eight = _mm_set1_epi8(8);
    let lo = _mm_sub_epi8(_mm_and_si128(packed, mask), eight);
    let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), eight);
    for (half, v) in [lo, hi].into_iter().enumerate() {
        for k in 0..2 {
            let bytes = if k == 0 { v } else { _mm_srli_si128(v, 8) };
            let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(16 * half + 8 * k),
                _mm256_mul_ps(scale, f),
            );
        }
    }
}

/// f16 bits to f32. The `half` crate's slice conversion checks the CPU and calls out once
/// per 8 values, which costs more than the conversion on head-sized rows.
fn f16_to_f32(src: &[u16], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // the AVX2 level includes F16C
        if crate::kernels::has_avx2() {
            // SAFETY: F16C and AVX were detected; both slices have the same length.
            return unsafe { f16_to_f32_f16c(src, out) };
        }
    }
    for (o, &h) in out.iter_mut().zip(src) {
        *o = f16::from_bits(h).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_to_f32_f16c(src: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    for j in i..n {
        out[j] = f16::from_bits(src[j]).to_f32();
    }
}

pub(super) fn bytemuck_u16(words: &[u32]) -> &[u16] {
    // SAFETY: u32 storage reinterpreted as twice as many u16; alignment of u16 divides that
    // of u32 and every bit pattern is a valid u16.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u16, words.len() * 2) }
}

pub(super) fn bytemuck_f32(words: &[u32]) -> &[f32] {
    // SAFETY: u32 and f32 have the same size and alignment and every bit pattern is a valid
    // f32.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const f32, words.len()) }
}

pub(super) fn bytemuck_u8(words: &[u32]) -> &[u8] {
    // SAFETY: u32 storage reinterpreted as four times as many bytes; every bit pattern is a
    // valid u8 and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 4) }
}
