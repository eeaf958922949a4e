// The engine's CUDA kernels. NVRTC compiles them after the CUDA prelude in `mod.rs` (no
// headers); the engine's tests compile them as C++ after `emulate.hpp`, which runs a launch's
// blocks on CPU threads, so their logic is checked on machines without a GPU.
//
// Conventions both compilers rely on: block-level data lives in the dynamic shared array
// `sh`; blocks are one-dimensional; every thread of a block reaches each `__syncthreads` and
// `block_reduce` (no early return before one); halves are `unsigned short`, converted by the
// prelude's `h2f` and `f2h`.

#define UNSEEN 0xffffffffu

// Every thread gets the block's maximum (`max`) or sum of `v`; `red` holds a float per warp.
__device__ float block_reduce(float v, float* red, bool max) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = max ? fmaxf(v, w) : v + w;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < warps; ++w) v = max ? fmaxf(v, red[w]) : v + red[w];
    __syncthreads();
    return v;
}

// Decode attention: block (i, h) is sequence i's query head h over the cache rows in
// `slots` (`l_max` per sequence; UNSEEN where it sees none), keys in tiles of blockDim.x
// with an online softmax.
extern "C" __global__ void paged_decode_attn(
    const float* q, const unsigned int* q_rows,
    const unsigned short* kc, const unsigned short* vc,
    const unsigned int* slots, float* out,
    int l_max, int n_head, int n_kv, int hd, float scale, float softcap)
{
    const float NEG_INF = __int_as_float(0xff800000);
    const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int kvh = h / (n_head / n_kv);
    const size_t kv_row = (size_t)n_kv * hd;
    extern __shared__ float sh[];
    float* qs = sh;
    float* ps = sh + hd;
    float* red = ps + nt;
    const float* qr = q + (size_t)q_rows[i] * n_head * hd + (size_t)h * hd;
    for (int d = tid; d < hd; d += nt) qs[d] = qr[d];
    __syncthreads();
    const unsigned int* sl = slots + (size_t)i * l_max;
    float m = NEG_INF, l = 0.f, acc0 = 0.f, acc1 = 0.f;
    for (int j0 = 0; j0 < l_max; j0 += nt) {
        const int j = j0 + tid;
        const unsigned int slot = j < l_max ? sl[j] : UNSEEN;
        float s = NEG_INF;
        if (slot != UNSEEN) {
            const unsigned short* kr = kc + (size_t)slot * kv_row + (size_t)kvh * hd;
            float dot = 0.f;
            for (int d = 0; d < hd; ++d) dot += qs[d] * h2f(kr[d]);
            s = dot * scale;
            if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        }
        const float m_new = fmaxf(m, block_reduce(s, red, true));
        const float p = slot != UNSEEN ? expf(s - m_new) : 0.f;
        const float corr = m == NEG_INF ? 0.f : expf(m - m_new);
        l = l * corr + block_reduce(p, red, false);
        m = m_new;
        acc0 *= corr;
        acc1 *= corr;
        ps[tid] = p;
        __syncthreads();
        const int nk = min(nt, l_max - j0);
        // (unrolled: independent loads of several keys' values in flight at once)
#pragma unroll 4
        for (int jj = 0; jj < nk; ++jj) {
            const float pj = ps[jj];
            if (pj == 0.f) continue;
            const unsigned short* vr = vc + (size_t)sl[j0 + jj] * kv_row + (size_t)kvh * hd;
            if (tid < hd) acc0 += pj * h2f(vr[tid]);
            if (tid + nt < hd) acc1 += pj * h2f(vr[tid + nt]);
        }
        __syncthreads();
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* o = out + (size_t)i * n_head * hd + (size_t)h * hd;
    if (tid < hd) o[tid] = acc0 * inv;
    if (tid + nt < hd) o[tid + nt] = acc1 * inv;
}

// The residual stream between sublayers, one block per row of `x` (`[n, d]`): `out` is
// `[2, n, d]`, `x + o` first (`o` RMS-normed with `post_w` first when that is given; `x`
// alone when `o` is null), then that sum RMS-normed with `w`. Norms divide by the root mean
// square, as candle's `rms_norm` does (multiplying by its inverse took a tiny model's
// logits past the tensor path's batch-invariance bound).
extern "C" __global__ void residual_norm(
    const float* x, const float* o, const float* post_w, const float* w, float* out, int n,
    int d, float eps)
{
    extern __shared__ float sh[];
    float* red = sh;
    const int tid = threadIdx.x, nt = blockDim.x;
    const size_t at = (size_t)blockIdx.x * d;
    float* xo = out + at;
    float* h = out + (size_t)n * d + at;
    float post = 1.f;
    if (o && post_w) {
        float ss = 0.f;
        for (int c = tid; c < d; c += nt) ss += o[at + c] * o[at + c];
        post = sqrtf(block_reduce(ss, red, false) / d + eps);
    }
    float ss = 0.f;
    // each thread reads back only the columns it wrote: no barrier needed
    for (int c = tid; c < d; c += nt) {
        const float y = x[at + c] + (o ? (post_w ? o[at + c] / post * post_w[c] : o[at + c]) : 0.f);
        xo[c] = y;
        ss += y * y;
    }
    const float m = sqrtf(block_reduce(ss, red, false) / d + eps);
    for (int c = tid; c < d; c += nt) h[c] = xo[c] / m * w[c];
}

// A gated unit's activation, one thread per output: `out[r, c] = act(gate[r, c]) * up[r, c]`
// (SiLU, or GELU's tanh form when `gelu`), gate and up rows `gs` and `us` floats apart (the
// halves of one stacked product, or two products).
extern "C" __global__ void glu(
    const float* gate, const float* up, float* out, int n, int ff, int gs, int us, int gelu)
{
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < (size_t)n * ff) {
        const size_t r = e / ff, c = e % ff;
        const float g = gate[r * gs + c];
        const float a = gelu
            ? 0.5f * g * (1.f + tanhf(0.7978845608028654f * g * (1.f + 0.044715f * g * g)))
            : g / (1.f + expf(-g));
        out[e] = a * up[r * us + c];
    }
}

// Q, K and V of each token into place, block (t, head) for token t: heads `0..n_head` are
// the queries, the next `n_kv` the keys, the last `n_kv` the values. Each adds its bias and
// (queries and keys) is RMS-normed by `q_norm`/`k_norm` when those are given, then queries
// and keys are rotated by the token's `cos`/`sin` (`half` pairs: halves `neox`, else
// neighbours; the dimensions past `2 * half` are left as they are). Queries go to `q_out`
// (`[n, n_head × hd]`), keys and values to the caches' rows `write_rows[t]` as halves
// (none where that is UNSEEN).
extern "C" __global__ void rope_store(
    const float* q, const float* k, const float* v, int qs, int ks, int vs,
    const float* q_bias, const float* k_bias, const float* v_bias,
    const float* q_norm, const float* k_norm, float eps,
    const float* cos, const float* sin, int half, int neox,
    const unsigned int* write_rows, float* q_out, unsigned short* kc, unsigned short* vc,
    int n_head, int n_kv, int hd)
{
    extern __shared__ float sh[];
    float* row = sh;
    float* red = sh + hd;
    const int t = blockIdx.x, hh = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int kind = hh < n_head ? 0 : hh < n_head + n_kv ? 1 : 2;
    // a padding row of a bucketed step writes no cache row (the whole block leaves at once)
    if (kind > 0 && write_rows[t] == UNSEEN) return;
    const int head = kind == 0 ? hh : kind == 1 ? hh - n_head : hh - n_head - n_kv;
    const float* src = kind == 0 ? q + (size_t)t * qs : kind == 1 ? k + (size_t)t * ks : v + (size_t)t * vs;
    const float* bias = kind == 0 ? q_bias : kind == 1 ? k_bias : v_bias;
    const float* norm = kind == 0 ? q_norm : kind == 1 ? k_norm : 0;
    src += (size_t)head * hd;
    float ss = 0.f;
    for (int d = tid; d < hd; d += nt) {
        const float x = src[d] + (bias ? bias[(size_t)head * hd + d] : 0.f);
        row[d] = x;
        ss += x * x;
    }
    if (norm) {
        const float m = sqrtf(block_reduce(ss, red, false) / hd + eps);
        for (int d = tid; d < hd; d += nt) row[d] = row[d] / m * norm[d];
    }
    __syncthreads();
    const size_t kv_at = (size_t)write_rows[t] * n_kv * hd + (size_t)head * hd;
    for (int d = tid; d < hd; d += nt) {
        float y = row[d];
        if (kind < 2 && d < 2 * half) {
            const int i = neox ? d % half : d / 2;
            const float c = cos[(size_t)t * half + i], s = sin[(size_t)t * half + i];
            const bool first = neox ? d < half : (d & 1) == 0;
            const float other = neox ? row[first ? d + half : d - half] : row[first ? d + 1 : d - 1];
            y = first ? row[d] * c - other * s : other * s + row[d] * c;
        }
        if (kind == 0)
            q_out[(size_t)t * n_head * hd + (size_t)head * hd + d] = y;
        else
            (kind == 1 ? kc : vc)[kv_at + d] = f2h(y);
    }
}

// The order of `f32::total_cmp` as unsigned integers: a larger key is a larger float (-0
// below +0, NaNs beyond the infinities by sign).
__device__ unsigned int order_key(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Each row's `window` best entries (`window` <= `n_vocab`, blockDim.x >= 256; sm_70 or later
// for the warps' digit matching), in the host
// sampler's candidate order: the larger logit first as `total_cmp` has it, then the lower
// id. Block r is row r of `logits` (rows `n_vocab` floats apart); `out` gets per row the
// candidates' ids (as floats: exact below 2^24), then their logits. An entry's place in the
// order is a 56-bit key (its value's order key, then its complemented id), unique per row:
// a radix select of 8 bits a pass finds the key of the `window`-th entry, stopping early
// when every entry on the chosen prefix is taken; the entries at or above it are gathered,
// then each one's rank among them is counted.
extern "C" __global__ void top_candidates(const float* logits, int n_vocab, int window, float* out)
{
    extern __shared__ float sh[];
    unsigned int* bins = (unsigned int*)sh;          // 257: a digit's counts, then a suffix sum
    unsigned int* state = bins + 257;                // the chosen digit, what is left, how many
    unsigned long long* keys = (unsigned long long*)(sh + 264);  // window gathered keys
    const int tid = threadIdx.x, nt = blockDim.x;
    const float* row = logits + (size_t)blockIdx.x * n_vocab;
    unsigned long long prefix = 0, mask = 0;
    unsigned int left = window;
    int shift = 48;
    for (; shift >= 0; shift -= 8) {
        for (int b = tid; b < 257; b += nt) bins[b] = 0;
        __syncthreads();
        // (every lane of a warp runs each round: the lanes holding one digit add together,
        // since a row's entries crowd into a few digits, the first pass's all into one or two)
        for (int base = 0; base < n_vocab; base += nt) {
            const int i = base + tid;
            unsigned int digit = 256;
            if (i < n_vocab) {
                const unsigned long long k =
                    ((unsigned long long)order_key(row[i]) << 24) | (0xffffffu - (unsigned int)i);
                if ((k & mask) == prefix) digit = (k >> shift) & 255u;
            }
            const unsigned int peers = __match_any_sync(0xffffffffu, digit);
            if (digit < 256 && (threadIdx.x & 31) == __ffs(peers) - 1)
                atomicAdd(&bins[digit], (unsigned int)__popc(peers));
        }
        __syncthreads();
        // suffix sums: bins[d] counts the entries on the prefix with a digit >= d
        for (int step = 1; step < 256; step <<= 1) {
            const unsigned int add = tid + step < 256 ? bins[tid + step] : 0;
            __syncthreads();
            if (tid < 256) bins[tid] += add;
            __syncthreads();
        }
        // the digit whose entries reach the `left`-th (exactly one thread finds it)
        if (tid < 256 && bins[tid] >= left && bins[tid + 1] < left) {
            state[0] = tid;
            state[1] = left - bins[tid + 1];
            state[2] = bins[tid] - bins[tid + 1];
        }
        __syncthreads();
        prefix |= (unsigned long long)state[0] << shift;
        mask |= 255ull << shift;
        const bool whole = state[1] == state[2];
        left = state[1];
        __syncthreads();
        // every entry on the prefix is taken: the threshold is the prefix itself
        if (whole) break;
    }
    if (tid == 0) state[3] = 0;
    __syncthreads();
    for (int i = tid; i < n_vocab; i += nt) {
        const unsigned long long k =
            ((unsigned long long)order_key(row[i]) << 24) | (0xffffffu - (unsigned int)i);
        if (k >= prefix) keys[atomicAdd(&state[3], 1u)] = k;
    }
    __syncthreads();
    float* o = out + (size_t)blockIdx.x * 2 * window;
    for (int c = tid; c < window; c += nt) {
        const unsigned long long k = keys[c];
        int rank = 0;
        for (int j = 0; j < window; ++j) rank += keys[j] > k;
        const unsigned int ok = (unsigned int)(k >> 24);
        o[rank] = (float)(0xffffffu - (unsigned int)(k & 0xffffffu));
        o[window + rank] = __uint_as_float((ok & 0x80000000u) ? (ok & 0x7fffffffu) : ~ok);
    }
}
