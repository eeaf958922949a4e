//! Throughput of the vector instructions the AVX2 products are made of, alone and mixed,
//! in instructions per nanosecond (multiply by the clock in GHz for per-cycle figures): which
//! of them share execution pipes on this CPU. Independent chains, no memory traffic.
//!
//!     cargo run --release --example simd_ports
//!
//! On Zen 4 `vpmaddubsw`, `vpmaddwd` and `vfmadd231ps`
//! each issue two per cycle alone, but one `vpmaddubsw` with one `vfmadd` only one pair per
//! cycle (they share two pipes), and one with two `vpaddw`s 1.2 triples per cycle (the adds
//! take the four vector pipes the multiplies' two are among). Where the CPU has AVX-512 VNNI
//! it also times `vpdpbusd` on 256 and on 512 bits: on a Sapphire Rapids-class Xeon each
//! issues about two a cycle, so the 512-bit form does twice the multiply-adds.

#[cfg(target_arch = "x86_64")]
// rustfmt wraps the probes' one-expression bodies below in braces
#[allow(unused_braces)]
mod probes {
    use std::arch::x86_64::*;

    /// Distinct starting values (hidden from the optimiser, which would otherwise merge
    /// identical chains or fold them).
    fn seeds<const N: usize>() -> [i32; N] {
        std::hint::black_box(std::array::from_fn(|i| i as i32 + 1))
    }

    /// 8 independent chains of `op`, `n` steps.
    macro_rules! chains {
        ($name:ident, $features:literal, $ty:ty, |$i:ident| $init:expr, |$s:ident, $k:ident| $op:expr) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name(n: usize) -> $ty {
                let $k = std::hint::black_box(3);
                let mut c: [$ty; 8] = seeds::<8>().map(|$i| $init);
                for _ in 0..n {
                    for $s in c.iter_mut() {
                        *$s = $op;
                    }
                }
                std::hint::black_box(c)[0]
            }
        };
    }

    chains!(
        maddubs,
        "avx2",
        __m256i,
        |i| _mm256_set1_epi32(i),
        |s, k| { _mm256_maddubs_epi16(*s, _mm256_set1_epi8(k)) }
    );
    chains!(madd, "avx2", __m256i, |i| _mm256_set1_epi32(i), |s, k| {
        _mm256_madd_epi16(*s, _mm256_set1_epi16(k as i16))
    });
    chains!(
        fmadd,
        "avx2,fma",
        __m256,
        |i| _mm256_set1_ps(i as f32),
        |s, k| { _mm256_fmadd_ps(*s, _mm256_set1_ps(0.999), _mm256_set1_ps(k as f32)) }
    );

    /// One `vpmaddubsw` and one `vfmadd` per chain and step.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn maddubs_fmadd(n: usize) -> __m256i {
        let k = std::hint::black_box(3);
        let mut s = seeds::<6>().map(|i| _mm256_set1_epi32(i));
        let mut f = seeds::<6>().map(|i| _mm256_set1_ps(i as f32));
        for _ in 0..n {
            for j in 0..6 {
                s[j] = _mm256_maddubs_epi16(s[j], _mm256_set1_epi8(k));
                f[j] = _mm256_fmadd_ps(f[j], _mm256_set1_ps(0.999), _mm256_set1_ps(k as f32));
            }
        }
        std::hint::black_box((s, f)).0[0]
    }

    /// One `vpmaddubsw` and two `vpaddw` per chain and step.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs_add16(n: usize) -> __m256i {
        let k = std::hint::black_box(3);
        let mut s = seeds::<6>().map(|i| _mm256_set1_epi32(i));
        let mut t = seeds::<6>().map(|i| _mm256_set1_epi32(i + 7));
        for _ in 0..n {
            for j in 0..6 {
                s[j] = _mm256_maddubs_epi16(s[j], _mm256_set1_epi8(k));
                t[j] = _mm256_add_epi16(_mm256_add_epi16(t[j], s[j]), _mm256_set1_epi16(k as i16));
            }
        }
        std::hint::black_box((s, t)).0[0]
    }

    /// `vpdpbusd` on 256 and on 512 bits, 12 accumulator chains (its latency is ~5 cycles).
    macro_rules! dpbusd {
        ($name:ident, $features:literal, $ty:ty, $set1:ident, $op:ident) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name(n: usize) -> $ty {
                let k = $set1(std::hint::black_box(0x0102_0304));
                let mut c = seeds::<12>().map(|i| $set1(i));
                for _ in 0..n {
                    for s in c.iter_mut() {
                        *s = $op(*s, k, k);
                    }
                }
                std::hint::black_box(c)[0]
            }
        };
    }
    dpbusd!(
        dpbusd_256,
        "avx2,avx512vnni,avx512vl",
        __m256i,
        _mm256_set1_epi32,
        _mm256_dpbusd_epi32
    );
    dpbusd!(
        dpbusd_512,
        "avx512f,avx512vnni",
        __m512i,
        _mm512_set1_epi32,
        _mm512_dpbusd_epi32
    );
}

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    if !is_x86_feature_detected!("avx2") || !is_x86_feature_detected!("fma") {
        println!("this CPU has no AVX2 + FMA");
        return;
    }
    let n = 20_000_000usize;
    let time = |name: &str, ops: usize, f: &dyn Fn(usize)| {
        let best = (0..3)
            .map(|_| {
                let t = Instant::now();
                f(n);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        println!("{name:34} {:5.2} per ns", (ops * n) as f64 / best / 1e9);
    };
    // SAFETY (every call below): AVX2 and FMA were detected above.
    time("vpmaddubsw", 8, &|n| unsafe {
        probes::maddubs(n);
    });
    time("vpmaddwd", 8, &|n| unsafe {
        probes::madd(n);
    });
    time("vfmadd231ps", 8, &|n| unsafe {
        probes::fmadd(n);
    });
    time("vpmaddubsw + vfmadd (pairs)", 6, &|n| unsafe {
        probes::maddubs_fmadd(n);
    });
    time("vpmaddubsw + 2 vpaddw (triples)", 6, &|n| unsafe {
        probes::maddubs_add16(n);
    });
    if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
        // (multiply-adds per ns: 32 a 256-bit `vpdpbusd`, 64 a 512-bit one)
        time("vpdpbusd ymm", 12, &|n| unsafe {
            probes::dpbusd_256(n);
        });
        time("vpdpbusd zmm", 12, &|n| unsafe {
            probes::dpbusd_512(n);
        });
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("x86_64 only");
}
