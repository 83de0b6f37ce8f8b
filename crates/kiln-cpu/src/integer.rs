//! The block products against input rows in 8-bit blocks ([`Q8Inputs`]):
//! a block's weights times its inputs summed exactly in i32, then scaled
//! once per block — llama.cpp's Q4_1 × Q8_1 and Q8_0 × Q8_0 arithmetic. For
//! a 4-bit block `w = s·u + m` and an input block `x ≈ d·q`:
//! `Σ w·x ≈ s·d·Σ u·q + m·(d·Σ q)`, the last factor kept with the inputs;
//! for an 8-bit block `w = s·v` (`v` in −127..=127): `Σ w·x ≈ s·d·Σ v·q`.
//!
//! The integer sums are exact, so every set of [`IntegerKernels`] gives the
//! same block sums; only the f32 sums over blocks differ in order. Sets:
//! AVX-512 VNNI (`vpdpbusd`, two blocks an instruction), AVX2 (`vpmaddubsw`
//! and `vpmaddwd`, a block in two) and portable loops for any CPU
//! (aarch64's among them). [`best`] is the first of
//! [`available`] this CPU runs.
//!
//! Both SIMD instructions multiply unsigned bytes by signed ones, and an
//! 8-bit block's weights are signed as its inputs are. AVX-512 VNNI offsets
//! the inputs to unsigned (`q ⊕ 0x80 = q + 128`, once a product) and keeps
//! the weights signed as stored; each i32 lane's sum of `(q + 128)·v` over
//! four bytes starts at `−128·Σ v` of its four weights (one more `vpdpbusd`
//! a row's pair of blocks, shared by every input row), so it ends at
//! exactly `Σ v·q`, as a signed product would (a correction per block in
//! f32 instead would cancel large terms, and round). Measured against
//! offsetting the weights (a `vpxorq` a pair, and a per-input correction
//! loaded a pair) and against llama.cpp's sign trick in 32-byte vectors,
//! it was the fastest in prefill and level in decode. AVX2's `vpmaddubsw`
//! adds pairs into saturating i16, which `(q + 128)·v` pairs would overflow
//! (2·255·127), so it multiplies `|v|` by `q` with `v`'s sign (`vpsignb`,
//! llama.cpp's way): at most 2·127·127 a pair, never saturating.

use std::sync::OnceLock;

use crate::blocks::{BLOCK, BLOCK_BYTES, Q4Blocks, Q8Blocks};
use crate::inputs::Q8Inputs;
#[cfg(target_arch = "x86_64")]
use crate::kernel::for_each_group;

/// `out[(r − first) · n + i] = Σ_c w[r][c] · x[i][c]` for the rows `first..`
/// that `out` has room for (`out.len() / n` of them), `x` in 8-bit blocks.
pub type Q4RowsOfQ8 = fn(m: &Q4Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]);

/// [`Q4RowsOfQ8`] of 8-bit blocks (Q8_0 × Q8_0).
pub type Q8RowsOfQ8 = fn(m: &Q8Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]);

/// One implementation of the integer product.
pub struct IntegerKernels {
    pub name: &'static str,
    /// Whether the set is SIMD code (the portable loops are not).
    pub simd: bool,
    pub q4_rows: Q4RowsOfQ8,
    pub q8_rows: Q8RowsOfQ8,
}

/// The integer kernel sets this CPU can run, fastest first; the portable
/// set last.
pub fn available() -> Vec<IntegerKernels> {
    let mut sets = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if vnni::detected() {
        sets.push(IntegerKernels {
            name: "avx512-vnni",
            simd: true,
            q4_rows: vnni::q4_rows_checked,
            q8_rows: vnni::q8_rows_checked,
        });
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::detected() {
        sets.push(IntegerKernels {
            name: "avx2",
            simd: true,
            q4_rows: avx2::q4_rows_checked,
            q8_rows: avx2::q8_rows_checked,
        });
    }
    sets.push(IntegerKernels {
        name: "portable",
        simd: false,
        q4_rows: portable_q4_rows,
        q8_rows: portable_q8_rows,
    });
    sets
}

/// The fastest integer kernel set this CPU runs.
pub fn best() -> &'static IntegerKernels {
    static BEST: OnceLock<IntegerKernels> = OnceLock::new();
    BEST.get_or_init(|| available().swap_remove(0))
}

/// `Σ a·b` of one block, exactly.
fn block_dot(a: impl Iterator<Item = i32>, b: &[i8]) -> i32 {
    a.zip(b).map(|(a, &b)| a * i32::from(b)).sum()
}

/// [`Q4RowsOfQ8`] without SIMD intrinsics.
pub fn portable_q4_rows(m: &Q4Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
    let blocks = m.blocks_per_row();
    let n = x.rows();
    for (r, out) in (first..).zip(out.chunks_exact_mut(n)) {
        let row_blocks = r * blocks..(r + 1) * blocks;
        let levels = &m.levels[row_blocks.start * BLOCK_BYTES..row_blocks.end * BLOCK_BYTES];
        let (scales, mins) = (&m.scales[row_blocks.clone()], &m.mins[row_blocks]);
        for (i, out) in out.iter_mut().enumerate() {
            let (q, d, sums) = x.row(i);
            let mut total = 0.0f32;
            for b in 0..blocks {
                let bytes = &levels[b * BLOCK_BYTES..][..BLOCK_BYTES];
                let (low, high) = q[b * BLOCK..][..BLOCK].split_at(BLOCK / 2);
                let dot = block_dot(bytes.iter().map(|&u| i32::from(u & 0x0f)), low)
                    + block_dot(bytes.iter().map(|&u| i32::from(u >> 4)), high);
                total += scales[b] * d[b] * dot as f32 + mins[b] * sums[b];
            }
            *out = total;
        }
    }
}

/// [`Q8RowsOfQ8`] without SIMD intrinsics.
pub fn portable_q8_rows(m: &Q8Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
    let blocks = m.blocks_per_row();
    let n = x.rows();
    for (r, out) in (first..).zip(out.chunks_exact_mut(n)) {
        let values = &m.values[r * m.cols..][..m.cols];
        let scales = &m.scales[r * blocks..][..blocks];
        for (i, out) in out.iter_mut().enumerate() {
            let (q, d, _) = x.row(i);
            let mut total = 0.0f32;
            for b in 0..blocks {
                let weights = values[b * BLOCK..][..BLOCK].iter().map(|&v| i32::from(v));
                let dot = block_dot(weights, &q[b * BLOCK..][..BLOCK]);
                total += scales[b] * d[b] * dot as f32;
            }
            *out = total;
        }
    }
}

/// AVX-512 with VNNI (and BW, VL): a pair of blocks is one 64-byte vector
/// of weights and one of inputs, multiplied and summed in fours by one
/// `vpdpbusd`; its sixteen i32 lanes (eight a block) are scaled by each
/// block's `s·d` and summed in f32 lanes. A row with an odd number of
/// blocks takes its last one in 32-byte vectors.
///
/// One input row (decode) is multiplied into [`ROWS`] output rows at once,
/// several input rows (prefill) into one output row: either way a few
/// independent sums are in flight, and the per-row work (the offset terms,
/// the horizontal sum) is spread over more arithmetic.
///
/// 8-bit blocks have kernels of their own ([`q8_rows`](vnni::q8_rows_checked)):
/// the inputs offset to unsigned bytes once a product, the weights the
/// signed operand as stored (the module's note). In decode four output
/// rows at once, each row's pairs in memory order, without the 4-bit
/// kernel's prefetch (which made the 8-bit rows' product from memory
/// slower, `kiln-bench-kernels --weights q8`); in prefill tiles of 2 rows ×
/// 4 inputs, each pair's weights and inputs loaded once for the tile's 8
/// sums.
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{BLOCK, BLOCK_BYTES, Q4Blocks, Q8Blocks, Q8Inputs, for_each_group};
    use std::arch::x86_64::*;

    /// Inputs a pair of blocks is applied to at once.
    const GROUP: usize = 8;

    /// Output rows one input row is applied to at once.
    const ROWS: usize = 4;

    /// Rows ahead whose levels are prefetched while a group of rows is
    /// multiplied: each product's rows are short (288 bytes on SmolLM2),
    /// and a product read from memory (`kiln-bench-kernels --copies`) ran
    /// faster with the prefetches than on the hardware prefetcher alone.
    const AHEAD: usize = 16;

    /// Whether this CPU runs the set.
    pub fn detected() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// [`q4_rows`], for [`super::available`], which lists it only where
    /// [`detected`].
    pub fn q4_rows_checked(m: &Q4Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        assert!(detected());
        // SAFETY: checked just above.
        unsafe { q4_rows(m, first, x, out) }
    }

    /// [`q8_rows`], as [`q4_rows_checked`].
    pub fn q8_rows_checked(m: &Q8Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        assert!(detected());
        // SAFETY: checked just above.
        unsafe { q8_rows(m, first, x, out) }
    }

    /// Output rows of an 8-bit tile in prefill.
    const TILE_ROWS: usize = 2;

    /// Inputs of an 8-bit tile in prefill.
    const TILE_INPUTS: usize = 4;

    /// Input rows as the 8-bit kernel takes them, `x`'s values offset to
    /// unsigned bytes (`q ⊕ 0x80 = q + 128`) and its scales spread as
    /// [`scale_lanes`]: made once a product.
    struct Unsigned<'x> {
        x: &'x Q8Inputs,
        values: Vec<u8>,
        lanes: Vec<__m512>,
    }

    /// [`super::Q8RowsOfQ8`] with AVX-512 VNNI.
    ///
    /// # Safety
    /// The CPU must run the set ([`detected`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q8_rows(m: &Q8Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        let inputs = Unsigned {
            x,
            values: x.values.iter().map(|&q| q.cast_unsigned() ^ 0x80).collect(),
            lanes: scale_lanes(x),
        };
        let n = x.rows();
        let rows = out.len() / n;
        if n == 1 {
            let mut chunks = out.chunks_exact_mut(ROWS);
            for (c, out) in (&mut chunks).enumerate() {
                q8_block::<ROWS, 1>(m, first + c * ROWS, &inputs, 0, out, 1);
            }
            let done = rows / ROWS * ROWS;
            for r in done..rows {
                q8_block::<1, 1>(m, first + r, &inputs, 0, &mut out[r..], 1);
            }
            return;
        }
        // Rows in tiles of 16 (as `for_each_group`), each against every
        // group of inputs: a group's inputs stay in L1 across the tile.
        for tile in (0..rows).step_by(16) {
            let end = (tile + 16).min(rows);
            for i in (0..n).step_by(TILE_INPUTS) {
                let group = TILE_INPUTS.min(n - i);
                let mut r = tile;
                while r < end {
                    let out = &mut out[r * n + i..];
                    if group == TILE_INPUTS && r + TILE_ROWS <= end {
                        q8_block::<TILE_ROWS, TILE_INPUTS>(m, first + r, &inputs, i, out, n);
                        r += TILE_ROWS;
                        continue;
                    }
                    match group {
                        1 => q8_block::<1, 1>(m, first + r, &inputs, i, out, n),
                        2 => q8_block::<1, 2>(m, first + r, &inputs, i, out, n),
                        3 => q8_block::<1, 3>(m, first + r, &inputs, i, out, n),
                        4 => q8_block::<1, 4>(m, first + r, &inputs, i, out, n),
                        g => unreachable!("a group of {g} inputs"),
                    }
                    r += 1;
                }
            }
        }
    }

    /// `R` 8-bit output rows from `row` against the `N` inputs from
    /// `start`, into `out[r · stride + k]`. A pair of blocks is one
    /// `vpdpbusd` of the inputs' unsigned bytes by the weights' signed
    /// ones, each i32 lane started at `−128·Σ v` of its four weights (one
    /// more `vpdpbusd` a row's pair, shared by the inputs): each lane ends
    /// at exactly `Σ v·q`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn q8_block<const R: usize, const N: usize>(
        m: &Q8Blocks,
        row: usize,
        inputs: &Unsigned,
        start: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let (cols, blocks) = (m.cols, m.blocks_per_row());
        let pairs = blocks / 2;
        let high = _mm512_set1_epi8(i8::MIN);
        // Through pointers taken from slices that hold whole rows: slicing
        // for each pair cost as many instructions as the arithmetic.
        let u: [*const u8; N] =
            std::array::from_fn(|k| inputs.values[(start + k) * cols..][..cols].as_ptr());
        let d: [*const __m512; N] =
            std::array::from_fn(|k| inputs.lanes[(start + k) * pairs..][..pairs].as_ptr());
        let w: [*const i8; R] =
            std::array::from_fn(|r| m.values[(row + r) * cols..][..cols].as_ptr());
        let scales: [&[f32]; R] =
            std::array::from_fn(|r| &m.scales[(row + r) * blocks..][..blocks]);
        // Row `r`'s pair `p`: its 64 weights and where its lanes start.
        let pair = |r: usize, p: usize| {
            // SAFETY: the row holds `2·pairs` blocks and `p < pairs`.
            let v = unsafe { _mm512_loadu_si512(w[r].add(p * 2 * BLOCK).cast()) };
            let offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), high, v);
            (v, _mm512_sub_epi32(_mm512_setzero_si512(), offset))
        };
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        if N == 1 {
            // Decode: row by row, each row's pairs in order, the weights
            // read in memory order for the hardware prefetcher.
            for (r, acc) in acc.iter_mut().enumerate() {
                for p in 0..pairs {
                    let (v, offset) = pair(r, p);
                    let s = pair_lanes(load_pair(scales[r], 2 * p));
                    // SAFETY: each input holds `2·pairs` blocks and `pairs`
                    // lanes (sliced above), and `p < pairs`.
                    let (q, d) = unsafe {
                        (
                            _mm512_loadu_si512(u[0].add(p * 2 * BLOCK).cast()),
                            *d[0].add(p),
                        )
                    };
                    let dot = _mm512_dpbusd_epi32(offset, q, v);
                    acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, d), acc[0]);
                }
            }
        } else {
            // Prefill: pair by pair, each input's loaded once for the rows.
            for p in 0..pairs {
                // SAFETY: as above.
                let q: [__m512i; N] = std::array::from_fn(|k| unsafe {
                    _mm512_loadu_si512(u[k].add(p * 2 * BLOCK).cast())
                });
                // SAFETY: as above.
                let d: [__m512; N] = std::array::from_fn(|k| unsafe { *d[k].add(p) });
                for (r, acc) in acc.iter_mut().enumerate() {
                    let (v, offset) = pair(r, p);
                    let s = pair_lanes(load_pair(scales[r], 2 * p));
                    for (k, acc) in acc.iter_mut().enumerate() {
                        let dot = _mm512_dpbusd_epi32(offset, q[k], v);
                        *acc =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, d[k]), *acc);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (k, acc) in acc.iter().enumerate() {
                let mut total = _mm512_reduce_add_ps(*acc);
                if blocks % 2 == 1 {
                    let b = blocks - 1;
                    let (_, d, _) = inputs.x.row(start + k);
                    let v = load32(&m.values[(row + r) * cols..][..cols], b * BLOCK);
                    let q = inputs.values[(start + k) * cols + b * BLOCK..][..BLOCK].as_ptr();
                    // SAFETY: the slice holds the 32 bytes the load reads.
                    let q = unsafe { _mm256_loadu_si256(q.cast()) };
                    let offset =
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(i8::MIN), v);
                    let offset = _mm256_sub_epi32(_mm256_setzero_si256(), offset);
                    let dot = _mm256_dpbusd_epi32(offset, q, v);
                    total += scales[r][b] * d[b] * reduce_add_epi32(dot) as f32;
                }
                out[r * stride + k] = total;
            }
        }
    }

    /// A matrix's rows as the kernel reads them: `pair(r, p)` gives row
    /// `r`'s blocks `2p` and `2p + 1` as 64 levels (bytes), `tail(r)` its
    /// last block as 32 where the row has an odd number; each block `b`
    /// adds `scales[b]·d·(its dot) + mins[b]·(d·Σ q)`.
    struct Weights<'m, P, T, F> {
        blocks: usize,
        pair: P,
        tail: T,
        /// Asks for the line of `pair(r, p)` ahead of its use (an address
        /// past the matrix is harmless: a prefetch does not fault).
        fetch: F,
        scales: &'m [f32],
        mins: &'m [f32],
    }

    /// [`super::Q4RowsOfQ8`] with AVX-512 VNNI.
    ///
    /// # Safety
    /// The CPU must run the set ([`detected`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q4_rows(m: &Q4Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        let blocks = m.blocks_per_row();
        let nibble = _mm256_set1_epi8(0x0f);
        // Quadwords of [low halves of blocks 0 and 1 | high halves] in
        // block order: block 0's 32 levels, then block 1's.
        let in_order = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
        let at = |r: usize, b: usize| (r * blocks + b) * BLOCK_BYTES;
        let weights = Weights {
            blocks,
            pair: |r: usize, p: usize| {
                let bytes = &m.levels[at(r, 2 * p)..][..2 * BLOCK_BYTES];
                // SAFETY: `bytes` holds the 32 bytes the load reads.
                let packed = unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) };
                let low = _mm256_and_si256(packed, nibble);
                let high = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), nibble);
                _mm512_permutex2var_epi64(
                    _mm512_castsi256_si512(low),
                    in_order,
                    _mm512_castsi256_si512(high),
                )
            },
            tail: |r: usize| {
                let bytes = &m.levels[at(r, blocks - 1)..][..BLOCK_BYTES];
                // SAFETY: `bytes` holds the 16 bytes the load reads.
                let packed = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
                let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
                _mm256_and_si256(both, nibble)
            },
            fetch: |r: usize, p: usize| {
                let line = m.levels.as_ptr().wrapping_add(at(r, 2 * p));
                _mm_prefetch::<_MM_HINT_T0>(line.cast())
            },
            scales: &m.scales,
            mins: &m.mins,
        };
        rows_of(&weights, first, x, out);
    }

    /// `f::<1, n>(args)` for a group of `n` inputs (1..=[`GROUP`]): each
    /// count its own code, whose accumulators stay in registers.
    macro_rules! by_count {
        ($n:expr, $f:ident, ($($arg:expr),*)) => {
            match $n {
                1 => $f::<1, 1, _, _, _>($($arg),*),
                2 => $f::<1, 2, _, _, _>($($arg),*),
                3 => $f::<1, 3, _, _, _>($($arg),*),
                4 => $f::<1, 4, _, _, _>($($arg),*),
                5 => $f::<1, 5, _, _, _>($($arg),*),
                6 => $f::<1, 6, _, _, _>($($arg),*),
                7 => $f::<1, 7, _, _, _>($($arg),*),
                8 => $f::<1, 8, _, _, _>($($arg),*),
                n => unreachable!("a group of {n} inputs"),
            }
        };
    }

    /// The output rows from `first` that `out` (`[rows, n]`) has room for.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn rows_of<P, T, F>(w: &Weights<'_, P, T, F>, first: usize, x: &Q8Inputs, out: &mut [f32])
    where
        P: Fn(usize, usize) -> __m512i,
        T: Fn(usize) -> __m256i,
        F: Fn(usize, usize),
    {
        let lanes = scale_lanes(x);
        let pairs = x.blocks_per_row() / 2;
        // Taken apart once a product, not once an output row.
        let inputs: Vec<Input> = (0..x.rows())
            .map(|i| {
                let (values, scales, sums) = x.row(i);
                Input {
                    values,
                    scales,
                    sums,
                    lanes: &lanes[i * pairs..][..pairs],
                }
            })
            .collect();
        if let [input] = inputs.as_slice() {
            let input = std::slice::from_ref(input);
            let mut chunks = out.chunks_exact_mut(ROWS);
            for (c, out) in (&mut chunks).enumerate() {
                block::<ROWS, 1, _, _, _>(w, first + c * ROWS, input, out);
            }
            let done = out.len() / ROWS * ROWS;
            for (r, out) in out[done..].chunks_exact_mut(1).enumerate() {
                block::<1, 1, _, _, _>(w, first + done + r, input, out);
            }
            return;
        }
        for_each_group::<GROUP>(first, inputs.len(), out, |r, group, out| {
            by_count!(group.len(), block, (w, r, &inputs[group], out));
        });
    }

    /// An input row taken apart: its values, block scales and sums, and its
    /// [`scale_lanes`].
    struct Input<'x> {
        values: &'x [i8],
        scales: &'x [f32],
        sums: &'x [f32],
        lanes: &'x [__m512],
    }

    /// `R` output rows from `row` against the `N` rows of `inputs` (`R`
    /// or `N` is 1), into `out[r · N + k]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn block<const R: usize, const N: usize, P, T, F>(
        w: &Weights<'_, P, T, F>,
        row: usize,
        inputs: &[Input],
        out: &mut [f32],
    ) where
        P: Fn(usize, usize) -> __m512i,
        T: Fn(usize) -> __m256i,
        F: Fn(usize, usize),
    {
        let blocks = w.blocks;
        let pairs = blocks / 2;
        let inputs: &[Input; N] = inputs.try_into().expect("a group of N inputs");
        // The inputs' loads go through pointers taken once: slicing them
        // for each pair cost as many instructions as the arithmetic.
        let q: [*const i8; N] = std::array::from_fn(|k| {
            assert!(inputs[k].values.len() >= 2 * pairs * BLOCK && inputs[k].lanes.len() == pairs);
            inputs[k].values.as_ptr()
        });
        let d: [*const __m512; N] = std::array::from_fn(|k| inputs[k].lanes.as_ptr());
        let scales: [&[f32]; R] =
            std::array::from_fn(|r| &w.scales[(row + r) * blocks..][..blocks]);
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        // Row by row, each row's pairs in order: the weights are read in
        // memory order, which the hardware prefetcher follows (reading
        // the rows side by side, pair by pair, halved the 8-bit output
        // projection's rate from memory); the rows' sums are independent
        // chains all the same.
        for (r, acc) in acc.iter_mut().enumerate() {
            for p in 0..pairs {
                let weights = (w.pair)(row + r, p);
                (w.fetch)(row + r + AHEAD, p);
                let s = pair_lanes(load_pair(scales[r], 2 * p));
                for (k, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: each input row holds `pairs` pairs of blocks
                    // and `pairs` lanes (checked above), and `p < pairs`.
                    let (q, d) = unsafe {
                        (
                            _mm512_loadu_si512(q[k].add(p * 2 * BLOCK).cast()),
                            *d[k].add(p),
                        )
                    };
                    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights, q);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, d), *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let mins = &w.mins[(row + r) * blocks..][..blocks];
            for (k, (acc, input)) in acc.iter().zip(inputs).enumerate() {
                let acc = add_products(*acc, mins, input.sums);
                let mut total = _mm512_reduce_add_ps(acc);
                if blocks % 2 == 1 {
                    let b = blocks - 1;
                    let dot = _mm256_dpbusd_epi32(
                        _mm256_setzero_si256(),
                        (w.tail)(row + r),
                        load32(input.values, b * BLOCK),
                    );
                    total += scales[r][b] * input.scales[b] * reduce_add_epi32(dot) as f32;
                }
                out[r * N + k] = total;
            }
        }
    }

    /// `[a, b]` (two f32) as sixteen lanes, eight of each.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn pair_lanes(pair: __m128) -> __m512 {
        let halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(pair))
    }

    /// Each pair of blocks' `d` of each row of `x` as [`pair_lanes`],
    /// `[rows, pairs]`: spread once a product, not once an output row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn scale_lanes(x: &Q8Inputs) -> Vec<__m512> {
        let pairs = x.blocks_per_row() / 2;
        let mut lanes = Vec::with_capacity(x.rows() * pairs);
        for d in x.scales.chunks_exact(x.blocks_per_row()) {
            lanes.extend((0..pairs).map(|p| pair_lanes(load_pair(d, 2 * p))));
        }
        lanes
    }

    /// Two f32 from `s[at..at + 2]` in the low lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn load_pair(s: &[f32], at: usize) -> __m128 {
        let s = &s[at..at + 2];
        // SAFETY: `s` holds the 8 bytes the load reads.
        unsafe { _mm_castpd_ps(_mm_load_sd(s.as_ptr().cast())) }
    }

    /// `acc + Σ_b a[b]·c[b]` in lanes, sixteen blocks a step (the blocks'
    /// `m·(d·Σ q)`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn add_products(acc: __m512, a: &[f32], c: &[f32]) -> __m512 {
        let mut acc = acc;
        for (a, c) in a.chunks(16).zip(c.chunks(16)) {
            let mask: __mmask16 = ((1u32 << a.len()) - 1) as u16;
            // SAFETY: the masked loads read the chunks' `len()` values only.
            let (a, c) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask, a.as_ptr()),
                    _mm512_maskz_loadu_ps(mask, c.as_ptr()),
                )
            };
            acc = _mm512_fmadd_ps(a, c, acc);
        }
        acc
    }

    /// 32 bytes of `v` from `at`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn load32(v: &[i8], at: usize) -> __m256i {
        let v = &v[at..at + 32];
        // SAFETY: `v` holds the 32 bytes the load reads.
        unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
    }

    /// The sum of eight i32 lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn reduce_add_epi32(v: __m256i) -> i32 {
        _mm512_reduce_add_epi32(_mm512_zextsi256_si512(v))
    }
}

/// AVX2 and FMA: a block is one 32-byte vector of levels and one of inputs;
/// `vpmaddubsw` multiplies them and adds neighbours into i16 (at most
/// 2·15·127, so it never saturates), `vpmaddwd` by ones adds those into
/// eight i32 lanes, scaled by the block's `s·d` into f32 lanes. As the
/// AVX-512 set: four output rows at once in decode, each row's blocks in
/// memory order; input rows in groups of four in prefill. An 8-bit block
/// is `|v|` against `q` with `v`'s sign (`vpsignb`; the module's note).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, BLOCK_BYTES, Q4Blocks, Q8Blocks, Q8Inputs, for_each_group};
    use std::arch::x86_64::*;

    /// Inputs a block is applied to at once.
    const GROUP: usize = 4;

    /// Output rows one input row is applied to at once.
    const ROWS: usize = 4;

    /// Whether this CPU runs the set.
    pub fn detected() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    /// [`q4_rows`], for [`super::available`], which lists it only where
    /// [`detected`].
    pub fn q4_rows_checked(m: &Q4Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        assert!(detected());
        // SAFETY: checked just above.
        unsafe { q4_rows(m, first, x, out) }
    }

    /// [`q8_rows`], as [`q4_rows_checked`].
    pub fn q8_rows_checked(m: &Q8Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        assert!(detected());
        // SAFETY: checked just above.
        unsafe { q8_rows(m, first, x, out) }
    }

    /// `f::<1, n>(args)` for a group of `n` inputs (1..=[`GROUP`]).
    macro_rules! by_count {
        ($n:expr, $f:ident, ($($arg:expr),*)) => {
            match $n {
                1 => $f::<1, 1>($($arg),*),
                2 => $f::<1, 2>($($arg),*),
                3 => $f::<1, 3>($($arg),*),
                4 => $f::<1, 4>($($arg),*),
                n => unreachable!("a group of {n} inputs"),
            }
        };
    }

    /// [`super::Q4RowsOfQ8`] with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must run the set ([`detected`]).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_rows(m: &Q4Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        if x.rows() == 1 {
            let mut chunks = out.chunks_exact_mut(ROWS);
            for (c, out) in (&mut chunks).enumerate() {
                block::<ROWS, 1>(m, first + c * ROWS, x, 0, out);
            }
            let done = out.len() / ROWS * ROWS;
            for (r, out) in out[done..].chunks_exact_mut(1).enumerate() {
                block::<1, 1>(m, first + done + r, x, 0, out);
            }
            return;
        }
        for_each_group::<GROUP>(first, x.rows(), out, |r, group, out| {
            by_count!(group.len(), block, (m, r, x, group.start, out));
        });
    }

    /// [`super::Q8RowsOfQ8`] with AVX2 and FMA, as [`q4_rows`].
    ///
    /// # Safety
    /// The CPU must run the set ([`detected`]).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q8_rows(m: &Q8Blocks, first: usize, x: &Q8Inputs, out: &mut [f32]) {
        if x.rows() == 1 {
            let mut chunks = out.chunks_exact_mut(ROWS);
            for (c, out) in (&mut chunks).enumerate() {
                q8_block::<ROWS, 1>(m, first + c * ROWS, x, 0, out);
            }
            let done = out.len() / ROWS * ROWS;
            for (r, out) in out[done..].chunks_exact_mut(1).enumerate() {
                q8_block::<1, 1>(m, first + done + r, x, 0, out);
            }
            return;
        }
        for_each_group::<GROUP>(first, x.rows(), out, |r, group, out| {
            by_count!(group.len(), q8_block, (m, r, x, group.start, out));
        });
    }

    /// [`block`] of 8-bit blocks: `|v|` (once a block) by each input's `q`
    /// with `v`'s sign, exactly `v·q` a byte.
    #[target_feature(enable = "avx2,fma")]
    fn q8_block<const R: usize, const N: usize>(
        m: &Q8Blocks,
        row: usize,
        x: &Q8Inputs,
        start: usize,
        out: &mut [f32],
    ) {
        let blocks = m.blocks_per_row();
        let ones = _mm256_set1_epi16(1);
        let inputs: [(&[i8], &[f32], &[f32]); N] = std::array::from_fn(|k| x.row(start + k));
        // Through pointers taken once, as in [`block`].
        let q: [*const i8; N] = std::array::from_fn(|k| {
            assert!(inputs[k].0.len() >= blocks * BLOCK && inputs[k].1.len() >= blocks);
            inputs[k].0.as_ptr()
        });
        let d: [*const f32; N] = std::array::from_fn(|k| inputs[k].1.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            let first = (row + r) * blocks;
            let values = &m.values[first * BLOCK..][..blocks * BLOCK];
            let scales = &m.scales[first..][..blocks];
            let (values, scales) = (values.as_ptr(), scales.as_ptr());
            for b in 0..blocks {
                // SAFETY: the row holds `blocks` blocks of values and
                // scales (sliced above), each input `blocks` blocks of
                // values and scales (checked above), and `b < blocks`.
                let (v, s) = unsafe {
                    (
                        _mm256_loadu_si256(values.add(b * BLOCK).cast()),
                        *scales.add(b),
                    )
                };
                let magnitudes = _mm256_sign_epi8(v, v);
                for k in 0..N {
                    // SAFETY: as above.
                    let (q, d) =
                        unsafe { (_mm256_loadu_si256(q[k].add(b * BLOCK).cast()), *d[k].add(b)) };
                    let signed = _mm256_sign_epi8(q, v);
                    let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, signed), ones);
                    let scale = _mm256_set1_ps(s * d);
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[k]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (k, acc) in acc.iter().enumerate() {
                out[r * N + k] = horizontal_sum(*acc);
            }
        }
    }

    /// `R` output rows from `row` against `N` input rows of `x` from
    /// `start` (`R` or `N` is 1), into `out[r · N + k]`.
    #[target_feature(enable = "avx2,fma")]
    fn block<const R: usize, const N: usize>(
        m: &Q4Blocks,
        row: usize,
        x: &Q8Inputs,
        start: usize,
        out: &mut [f32],
    ) {
        let blocks = m.blocks_per_row();
        let nibble = _mm_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let inputs: [(&[i8], &[f32], &[f32]); N] = std::array::from_fn(|k| x.row(start + k));
        // Through pointers taken once (each checked to hold `blocks`
        // blocks): slicing per block kept the loop's iterators in memory.
        let q: [*const i8; N] = std::array::from_fn(|k| {
            assert!(inputs[k].0.len() >= blocks * BLOCK && inputs[k].1.len() >= blocks);
            inputs[k].0.as_ptr()
        });
        let d: [*const f32; N] = std::array::from_fn(|k| inputs[k].1.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            let first = (row + r) * blocks;
            let levels = &m.levels[first * BLOCK_BYTES..][..blocks * BLOCK_BYTES];
            let scales = &m.scales[first..][..blocks];
            let (levels, scales) = (levels.as_ptr(), scales.as_ptr());
            for b in 0..blocks {
                // SAFETY: the row holds `blocks` blocks of levels and
                // scales (sliced above), each input `blocks` blocks of
                // values and scales (checked above), and `b < blocks`.
                let (packed, s) = unsafe {
                    (
                        _mm_loadu_si128(levels.add(b * BLOCK_BYTES).cast()),
                        *scales.add(b),
                    )
                };
                let low = _mm_and_si128(packed, nibble);
                let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), nibble);
                let w = _mm256_set_m128i(high, low);
                for k in 0..N {
                    // SAFETY: as above.
                    let (q, d) =
                        unsafe { (_mm256_loadu_si256(q[k].add(b * BLOCK).cast()), *d[k].add(b)) };
                    let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), ones);
                    let scale = _mm256_set1_ps(s * d);
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[k]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let mins = &m.mins[(row + r) * blocks..][..blocks];
            for (k, (acc, (_, _, sums))) in acc.iter().zip(&inputs).enumerate() {
                let offsets: f32 = mins.iter().zip(*sums).map(|(m, s)| m * s).sum();
                out[r * N + k] = horizontal_sum(*acc) + offsets;
            }
        }
    }

    /// The sum of the eight lanes.
    #[target_feature(enable = "avx2,fma")]
    fn horizontal_sum(v: __m256) -> f32 {
        let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
        let one = _mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs));
        _mm_cvtss_f32(one)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_products::{exact_products, later_rows_alone, random_product};
    use kiln_core::weights::Matrix;
    use proptest::prelude::*;

    /// Every available set computes the product of the dequantized weights
    /// and the dequantized inputs (up to f32 sums over blocks), and so is
    /// within the inputs' rounding bound of the product with the exact
    /// inputs; a later first row writes only its own rows.
    fn check(w: &Matrix, x: &[f32], q: &Q8Inputs, kernel: &dyn Fn(usize, &mut [f32])) {
        let n = q.rows();
        let of_rounded = exact_products(w, &q.dequantize());
        let exact = exact_products(w, x);
        let mut got = vec![0.0; w.rows * n];
        kernel(0, &mut got);
        for (k, g) in got.iter().enumerate() {
            let (r, i) = (k / n, k % n);
            let magnitude: f64 = w
                .row(r)
                .iter()
                .zip(&x[i * w.cols..][..w.cols])
                .map(|(a, b)| f64::from((a * b).abs()))
                .sum();
            let f32_sums = 1e-5 * (magnitude + 1.0);
            let g = f64::from(*g);
            assert!(
                (g - of_rounded[k]).abs() <= f32_sums,
                "output {k}: {g} against {} of the rounded inputs",
                of_rounded[k]
            );
            let bound = q.rounding_bound(i, &w.row(r)) + f32_sums;
            assert!(
                (g - exact[k]).abs() <= bound,
                "output {k}: {g} against {} exactly, bound {bound}",
                exact[k]
            );
        }
        later_rows_alone(w.rows, &got, kernel);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn the_integer_kernel_computes_the_product_of_the_rounded_inputs(
            // Past a row tile (16) and the input group (8), partial ones
            // included; odd block counts take the single-block tail.
            height in 1usize..40,
            blocks in 1usize..6,
            n in 1usize..20,
            seed in any::<u64>(),
        ) {
            let cols = blocks * BLOCK;
            let (w, x) = random_product(seed, height, cols, n);
            let q = Q8Inputs::quantize(&x, cols);
            let q4 = Q4Blocks::quantize(&w).unwrap();
            let q8 = Q8Blocks::quantize(&w).unwrap();
            // Blocks of the extremes and of zeros, against inputs with
            // zero blocks and blocks of one large value.
            let edges = edge_blocks(seed, height, cols);
            let mut spiky = x.clone();
            for (b, block) in spiky.chunks_exact_mut(BLOCK).enumerate() {
                match b % 3 {
                    0 => block.fill(0.0),
                    1 => block[b % BLOCK] = 1e4,
                    _ => {}
                }
            }
            let q_spiky = Q8Inputs::quantize(&spiky, cols);
            let sets = available();
            prop_assert!(!sets.is_empty());
            for kernels in sets {
                eprintln!("{}", kernels.name);
                check(&q4.dequantize(), &x, &q, &|first, out| (kernels.q4_rows)(&q4, first, &q, out));
                check(&q8.dequantize(), &x, &q, &|first, out| (kernels.q8_rows)(&q8, first, &q, out));
                check(&edges.dequantize(), &spiky, &q_spiky, &|first, out| {
                    (kernels.q8_rows)(&edges, first, &q_spiky, out)
                });
            }
        }

        /// With every scale 1 or ½ each product is a sum of integers (and
        /// halves and quarters) that f32 holds exactly whatever its order:
        /// every set gives `Σ s·d·Σ v·q` to the bit, the blocks' integer
        /// sums exact (the offset and the sign trick undone), on values
        /// that are mostly the extremes ±127 and zero blocks.
        #[test]
        fn the_8_bit_kernels_sum_exactly_in_integers(
            height in 1usize..40,
            blocks in 1usize..6,
            n in 1usize..20,
            seed in any::<u64>(),
        ) {
            let cols = blocks * BLOCK;
            let mut m = edge_blocks(seed, height, cols);
            let halves = |i: usize| if i % 3 == 1 { 0.5 } else { 1.0 };
            for (b, s) in m.scales.iter_mut().enumerate() {
                *s = if *s == 0.0 { 0.0 } else { halves(b) };
            }
            let x = edge_blocks(seed ^ 0x9e37_79b9, n, cols);
            let scales: Vec<f32> = x.scales.iter().enumerate()
                .map(|(b, &d)| if d == 0.0 { 0.0 } else { halves(b + 1) })
                .collect();
            let sums = x.values.chunks_exact(BLOCK).zip(&scales)
                .map(|(q, &d)| d * q.iter().map(|&v| f32::from(v)).sum::<f32>())
                .collect();
            let x = Q8Inputs { cols, values: x.values, scales, sums };
            let mut want = vec![0.0f64; height * n];
            for (r, i) in (0..height).flat_map(|r| (0..n).map(move |i| (r, i))) {
                let (q, d, _) = x.row(i);
                want[r * n + i] = (0..blocks)
                    .map(|b| {
                        let at = r * cols + b * BLOCK;
                        let dot: i64 = m.values[at..][..BLOCK].iter().zip(&q[b * BLOCK..][..BLOCK])
                            .map(|(&v, &q)| i64::from(v) * i64::from(q))
                            .sum();
                        f64::from(m.scales[r * blocks + b]) * f64::from(d[b]) * dot as f64
                    })
                    .sum();
            }
            for kernels in available() {
                let mut got = vec![f32::NAN; height * n];
                (kernels.q8_rows)(&m, 0, &x, &mut got);
                for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    prop_assert!(f64::from(g) == w, "{}: output {}: {} against {}", kernels.name, k, g, w);
                }
            }
        }
    }

    /// `rows × cols` 8-bit blocks from `seed`: each block all zeros (scale
    /// 0), all ±127, or a mix of −127, 127, 0 and anything between, with
    /// a scale in [0.001, 0.03).
    fn edge_blocks(seed: u64, rows: usize, cols: usize) -> Q8Blocks {
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut m = Q8Blocks {
            rows,
            cols,
            values: Vec::with_capacity(rows * cols),
            scales: Vec::with_capacity(rows * cols / BLOCK),
        };
        for _ in 0..rows * cols / BLOCK {
            let kind = next() % 4;
            m.scales.push(match kind {
                0 => 0.0,
                _ => 0.001 + (next() % 1000) as f32 * 2.9e-5,
            });
            m.values
                .extend((0..BLOCK).map(|_| match (kind, next() % 4) {
                    (0, _) => 0,
                    (1, pick) => [-127, 127][pick as usize % 2],
                    (_, 0) => -127,
                    (_, 1) => 127,
                    (_, 2) => 0,
                    _ => ((next() % 255) as i32 - 127) as i8,
                }));
        }
        m
    }

    /// A NaN or infinite activation makes its input row's products NaN
    /// (as a non-finite product in the reference does), against zero
    /// weight blocks too, in a pair of blocks and in a row's odd last
    /// block, with either kind of blocks; the other rows are untouched.
    #[test]
    fn non_finite_activations_give_nan_products() {
        let (cols, n) = (3 * BLOCK, 3);
        let (mut w, x) = random_product(11, 9, cols, n);
        w.f32_mut()[..cols].fill(0.0);
        let q4 = Q4Blocks::quantize(&w).unwrap();
        let q8 = Q8Blocks::quantize(&w).unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [5, 2 * BLOCK + 7] {
                let mut x = x.clone();
                x[cols + at] = bad;
                let q = Q8Inputs::quantize(&x, cols);
                for kernels in available() {
                    for (name, out) in [
                        ("q4", {
                            let mut out = vec![0.0; 9 * n];
                            (kernels.q4_rows)(&q4, 0, &q, &mut out);
                            out
                        }),
                        ("q8", {
                            let mut out = vec![0.0; 9 * n];
                            (kernels.q8_rows)(&q8, 0, &q, &mut out);
                            out
                        }),
                    ] {
                        for (k, v) in out.iter().enumerate() {
                            let what =
                                format!("{} {name}, {bad} at {at}: output {k}", kernels.name);
                            match k % n {
                                1 => assert!(v.is_nan(), "{what}: {v}"),
                                _ => assert!(v.is_finite(), "{what}: {v}"),
                            }
                        }
                    }
                }
            }
        }
    }

    /// The x86-64 machines CI runs on have AVX-512 VNNI: every SIMD set must
    /// be among those tested there, or the tests above hold only some.
    /// Elsewhere the test says what it skipped.
    #[test]
    fn the_simd_sets_run_where_the_cpu_has_them() {
        let names: Vec<&str> = available().iter().map(|k| k.name).collect();
        #[cfg(target_arch = "x86_64")]
        if vnni::detected() {
            assert_eq!(names, ["avx512-vnni", "avx2", "portable"]);
            return;
        }
        eprintln!("skipped: this CPU lacks AVX-512 VNNI; the sets tested: {names:?}");
    }
}
