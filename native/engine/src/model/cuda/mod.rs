//! The engine's own CUDA kernels: the steps of a decode layer that candle runs as several
//! launches each (attention over the paged cache, the residual adds with their norms, the
//! gated activation, the rotation of Q and K with the cache writes), one launch each. A GPU
//! decode step is bound by its launches (about 7 µs of host time apiece through candle), not
//! by its bytes. One more picks a sampled row's best candidates where the logits are, so
//! that a step brings back those instead of vocabulary-wide rows.
//!
//! The kernels' source ([`SOURCE`], `kernels.cu`) is compiled by NVRTC at first use, after
//! [`CUDA_PRELUDE`] (no CUDA headers), so a build needs no `nvcc`. The engine's tests also
//! compile it as C++ and run it on CPU threads (`emulate.hpp`), so the kernels' logic is
//! checked against candle's CPU ops on machines without a GPU; and each op has a CPU form
//! with its kernel's arithmetic (`ops.rs`), so the tensor path's tests on candle's CPU
//! device run with them on as well (`LLAMA_CPP_EX_CUDA_KERNELS` applies there too).

pub(super) mod graph;
mod ops;
pub(super) use ops::{DecodeAttention, Glu, ResidualNorm, RopeStore, TopCandidates};

#[cfg(test)]
mod emulate;

/// The kernels.
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
pub(super) const SOURCE: &str = include_str!("kernels.cu");

/// Threads per block of the attention kernel: one key per thread when scoring, one or two
/// output columns per thread when summing values.
pub(super) const ATTN_THREADS: u32 = 128;
/// Head dimensions the attention kernel takes (two output columns per thread at most).
pub(super) const MAX_HEAD_DIM: usize = 2 * ATTN_THREADS as usize;
/// Threads per block (a row) of `residual_norm`.
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
pub(super) const ROW_THREADS: u32 = 256;
/// Threads per block of `glu` (an output each).
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
pub(super) const GLU_THREADS: u32 = 256;
/// Threads per block (a token's head) of `rope_store`.
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
pub(super) const ROPE_THREADS: u32 = 128;

/// Threads per block (a row) of `top_candidates` (at least 256: a thread per digit value).
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
pub(super) const TOP_THREADS: u32 = 1024;

/// What NVRTC compiles ahead of [`SOURCE`]: half conversions as one PTX instruction each.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) const CUDA_PRELUDE: &str = r#"
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}
"#;

/// Which of the kernels run, from `LLAMA_CPP_EX_CUDA_KERNELS`: `1` or `all` for every one, or
/// a comma-separated list of `attention`, `norm`, `glu`, `rope`, `candidates`. None by default until a GPU
/// has run the engine's parity tests through them (`scripts/gpu_check.sh run` runs them all
/// on, then each alone where that fails); on candle's CPU device their CPU forms run, which
/// is how `make test` runs the tensor path's tests with them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Kernels {
    pub attention: bool,
    pub norm: bool,
    pub glu: bool,
    pub rope: bool,
    /// A sampled row's best candidates in place of its row ([`TopCandidates`]).
    pub candidates: bool,
}

impl Kernels {
    /// Every kernel.
    pub const ALL: Kernels = Kernels {
        attention: true,
        norm: true,
        glu: true,
        rope: true,
        candidates: true,
    };

    /// Parses the variable's value; an unknown name is an error naming it.
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut k = Kernels::default();
        for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match name {
                "1" | "all" => k = Kernels::ALL,
                "0" | "none" => k = Kernels::default(),
                "attention" => k.attention = true,
                "norm" => k.norm = true,
                "glu" => k.glu = true,
                "rope" => k.rope = true,
                "candidates" => k.candidates = true,
                other => {
                    return Err(format!(
                        "LLAMA_CPP_EX_CUDA_KERNELS: unknown kernel {other:?} \
                         (attention, norm, glu, rope, candidates, all)"
                    ))
                }
            }
        }
        Ok(k)
    }

    /// The process's choice (read once).
    pub fn from_env() -> Result<Self, String> {
        static CHOICE: std::sync::OnceLock<Result<Kernels, String>> = std::sync::OnceLock::new();
        CHOICE
            .get_or_init(|| match std::env::var("LLAMA_CPP_EX_CUDA_KERNELS") {
                Ok(v) => Kernels::parse(&v),
                Err(_) => Ok(Kernels::default()),
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::Kernels;

    /// The kernels' sentinel for a key no query sees is the plan's.
    #[test]
    fn the_kernels_skip_the_slots_the_plan_marks_unseen() {
        let unseen = format!("#define UNSEEN {:#x}u", crate::model::tensor::UNSEEN);
        assert!(super::SOURCE.contains(&unseen), "{unseen}");
    }

    #[test]
    fn the_kernel_choice_parses_names_and_refuses_unknown_ones() {
        assert_eq!(Kernels::parse(""), Ok(Kernels::default()));
        let all = Kernels::parse("1").unwrap();
        assert_eq!(all, Kernels::ALL);
        assert!(all.attention && all.norm && all.glu && all.rope && all.candidates);
        assert_eq!(Kernels::parse("all"), Ok(all));
        let some = Kernels::parse("attention, glu").unwrap();
        assert!(some.attention && some.glu && !some.norm && !some.rope);
        let err = Kernels::parse("attention,flash").unwrap_err();
        assert!(err.contains("\"flash\""), "{err}");
    }
}
