//! Kernels of kiln's own, for what IREE's code generation does not make
//! fast: CUDA C under `crates/kiln-xla/kernels/`, compiled to PTX by `cargo
//! xtask kernels` (the PTX is committed beside its source, so a build needs
//! no CUDA compiler), embedded in the modules that dispatch them
//! ([`Function::dispatch_extern`]) and assembled for the real GPU by its
//! driver at load time, as IREE's own kernels are.

use crate::q4::BLOCK;
use crate::stablehlo::{ExternDispatch, ExternObject, ExternResult, Function, Ty, Val};

/// The one-row q4 product (`kernels/q4_row.cu`).
pub static Q4_ROW: ExternObject = ExternObject {
    name: "kiln_q4_row",
    ptx: include_str!("../kernels/q4_row.ptx"),
};

/// [`Q4_ROW`]'s only entry point; rows a warp are its last constant. IREE
/// links every `hal.dispatch.extern` of one object in a module into one
/// executable that exports the first dispatch's entry only, and every
/// dispatch runs it: with an entry per row count, the products of two and
/// four rows a warp ran the one-row code over a grid made for more rows
/// and left half or three quarters of their outputs unwritten (found on an
/// H100, 2026-12-05: NaN and infinite logits on random-100m).
pub const Q4_ROW_ENTRY: &str = "kiln_q4_row";

/// The one-row q8 product (`kernels/q8_row.cu`: `q4_row.cu` built for 8-bit
/// blocks), and its only entry point.
pub static Q8_ROW: ExternObject = ExternObject {
    name: "kiln_q8_row",
    ptx: include_str!("../kernels/q8_row.ptx"),
};
pub const Q8_ROW_ENTRY: &str = "kiln_q8_row";

/// The first half of decode attention (`kernels/attend_part.cu`): each
/// split of a row's positions attended by one workgroup.
pub static ATTEND_PART: ExternObject = ExternObject {
    name: "kiln_attend_part",
    ptx: include_str!("../kernels/attend_part.ptx"),
};

/// The second half (`kernels/attend_merge.cu`): the splits combined.
pub static ATTEND_MERGE: ExternObject = ExternObject {
    name: "kiln_attend_merge",
    ptx: include_str!("../kernels/attend_merge.ptx"),
};

/// A decode step's rotary embedding and cache append
/// (`kernels/rope_append.cu`).
pub static ROPE_APPEND: ExternObject = ExternObject {
    name: "kiln_rope_append",
    ptx: include_str!("../kernels/rope_append.ptx"),
};

/// Every object a module may dispatch: [`crate::stablehlo::module`] adds
/// the ones its functions use (llama.rs hands it this list).
pub static OBJECTS: [&ExternObject; 5] =
    [&Q4_ROW, &Q8_ROW, &ATTEND_PART, &ATTEND_MERGE, &ROPE_APPEND];

/// Warps in one of [`Q4_ROW`]'s workgroups (`WARPS` in the source).
const Q4_ROW_WARPS: usize = 8;

/// The fewest workgroups a [`Q4_ROW`] product is given before a warp takes
/// more than one row: somewhat more than one per SM of an H100 (132).
/// Rows per warp share the workgroup's rounding of the row, which every
/// workgroup pays; workgroups keep the SMs' loads in flight. On an H100
/// (2026-12-07, `scripts/q4_kernel_bench.cu`, each product with its
/// decode step's fusions) 160 chose the faster of 1, 2 and 4 rows for
/// Llama-3.1-8B's qkv (4 rows, 192 workgroups: 9.1 µs against 10.1 at 2)
/// and TinyLlama's (2 rows, 160 workgroups: 4.1 µs against 5.5 at 1), and
/// kept the rest (256 chose 2 and 1 rows for those).
const Q4_ROW_MIN_WORKGROUPS: usize = 160;

/// Rows a warp takes in a product of `out` outputs: 4, 2 or 1, the most
/// that still gives [`Q4_ROW_MIN_WORKGROUPS`].
pub fn q4_rows_per_warp(out: usize) -> usize {
    [4, 2]
        .into_iter()
        .find(|rows| out.div_ceil(rows * Q4_ROW_WARPS) >= Q4_ROW_MIN_WORKGROUPS)
        .unwrap_or(1)
}

/// The RMSNorm a [`q4_row`] product applies to its row.
pub struct RowNorm<'a> {
    pub eps: f32,
    /// `[in]` f16.
    pub weight: &'a Val,
}

/// The work around a [`q4_row`] product that its kernel takes in, each of
/// which would otherwise be a small kernel of its own in every layer of a
/// decode step (a launch of a few µs, more than a small product's time).
#[derive(Default)]
pub struct RowFusion<'a> {
    /// The product is of the RMSNorm'd row.
    pub norm: Option<RowNorm<'a>>,
    /// `x` is an MLP's gate and up halves (`[2 · in]`), and the row is
    /// `SiLU(gate) · up`.
    pub swiglu: bool,
    /// `[out]` f32 added to the outputs (the residual stream).
    pub residual: Option<&'a Val>,
    /// The matrix's rows are an MLP's gate and up rows in pairs (gate row
    /// i, then up row i), and the product is `SiLU(gate) · up`, `[out /
    /// 2]`: the hidden row the down product reads.
    pub paired_swiglu: bool,
}

/// [`RowFusion::swiglu`], [`RowFusion::residual`] and
/// [`RowFusion::paired_swiglu`] as the kernel's last constant
/// (`INPUT_SWIGLU`, `OUTPUT_RESIDUAL`, `OUTPUT_SWIGLU` in `q4_row.cu`).
const Q4_ROW_SWIGLU: u32 = 1;
const Q4_ROW_RESIDUAL: u32 = 2;
const Q4_ROW_PAIRED_SWIGLU: u32 = 4;

/// One f32 row `x` `[in]` times q4 weights (`quants` `[out, in / BLOCK,
/// BLOCK]` i4, `scales` and `offsets` `[out, in / BLOCK]` f16) with
/// [`Q4_ROW`]: `[out]` f32. The kernel rounds each block of the row to
/// 16-bit levels, as the CPU graph's integer product does. With a norm
/// (`fusion.norm`), the product is that of the RMSNorm'd row: the kernel
/// reads the whole row anyway, so it multiplies it by the norm's weight as
/// it rounds it, sums its squares and scales its outputs by `1 /
/// sqrt(mean(x²) + eps)`. That spares the step the norm's reduction and
/// scaling kernels, and the matrix keeps its blocks as given (no norm
/// weight folded into them). Likewise it combines an MLP's halves as it
/// reads them (`fusion.swiglu`), adds the residual as it writes
/// (`fusion.residual`), or takes an MLP's paired rows' outputs as
/// `SiLU(gate) · up` (`fusion.paired_swiglu`).
pub fn q4_row(
    f: &mut Function,
    quants: &Val,
    scales: &Val,
    offsets: &Val,
    x: &Val,
    fusion: RowFusion,
) -> Val {
    assert_eq!(quants.ty, Ty::I4, "q4_row: values");
    assert_eq!(quants.shape[2], BLOCK, "q4_row: block width");
    let bytes = f.i4_as_bytes(quants);
    block_row(
        f,
        (&Q4_ROW, Q4_ROW_ENTRY),
        &bytes,
        scales,
        offsets,
        x,
        fusion,
    )
}

/// [`q4_row`] for q8 weights (`quants` `[out, in / BLOCK, BLOCK]` i8,
/// `scales` `[out, in / BLOCK]` f16) with [`Q8_ROW`], the same kernel built
/// for 8-bit blocks: the same rounding of the row and the same fusions.
pub fn q8_row(f: &mut Function, quants: &Val, scales: &Val, x: &Val, fusion: RowFusion) -> Val {
    assert_eq!(quants.ty, Ty::I8, "q8_row: values");
    assert_eq!(quants.shape[2], BLOCK, "q8_row: block width");
    // No offsets: the binding is not read, the scales stand in for it.
    block_row(
        f,
        (&Q8_ROW, Q8_ROW_ENTRY),
        quants,
        scales,
        scales,
        x,
        fusion,
    )
}

/// The dispatch of [`q4_row`] and [`q8_row`]: `bytes` the values as bytes.
fn block_row(
    f: &mut Function,
    (object, entry): (&'static ExternObject, &'static str),
    bytes: &Val,
    scales: &Val,
    offsets: &Val,
    x: &Val,
    fusion: RowFusion,
) -> Val {
    let (out, blocks) = (bytes.shape[0], bytes.shape[1]);
    let RowFusion {
        norm,
        swiglu,
        residual,
        paired_swiglu,
    } = fusion;
    let halves = if swiglu { 2 } else { 1 };
    assert_eq!(x.shape, [halves * blocks * BLOCK], "q4_row: row shape");
    assert_eq!(x.ty, Ty::F32, "q4_row: row type");
    // The kernel indexes blocks in 32 bits.
    assert!(out * blocks < 1 << 32, "q4_row: {out}x{blocks} blocks");
    // eps 0 says "no norm", and the weight binding is then not read: the
    // scales stand in for it. An RMSNorm's eps is positive.
    let (eps_bits, weight) = match &norm {
        Some(RowNorm { eps, weight }) => {
            assert!(*eps > 0.0, "q4_row: eps {eps}");
            assert_eq!(weight.shape, [blocks * BLOCK], "q4_row: norm weight shape");
            assert_eq!(weight.ty, Ty::F16, "q4_row: norm weight type");
            (eps.to_bits(), *weight)
        }
        None => (0, scales),
    };
    // Likewise the residual's binding, unread without the flag.
    let (residual, residual_flag) = match residual {
        Some(r) => {
            assert_eq!(
                (&r.shape[..], r.ty),
                (&[out][..], Ty::F32),
                "q4_row: residual"
            );
            (r, Q4_ROW_RESIDUAL)
        }
        None => (x, 0),
    };
    assert!(
        !paired_swiglu || (out.is_multiple_of(2) && residual_flag == 0),
        "q4_row: {out} paired rows"
    );
    let flags = residual_flag
        | if swiglu { Q4_ROW_SWIGLU } else { 0 }
        | if paired_swiglu {
            Q4_ROW_PAIRED_SWIGLU
        } else {
            0
        };
    // A warp holds both rows of each of its pairs.
    let rows = q4_rows_per_warp(out).max(if paired_swiglu { 2 } else { 1 });
    f.dispatch_extern(
        &ExternDispatch {
            object,
            // One entry for every row count (see `Q4_ROW_ENTRY`).
            entry,
            workgroups: out.div_ceil(rows * Q4_ROW_WARPS),
            workgroup_size: Q4_ROW_WARPS * 32,
            constants: &[out as u32, blocks as u32, rows as u32, eps_bits, flags],
        },
        &[bytes, scales, offsets, x, weight, residual],
        &[if paired_swiglu { out / 2 } else { out }],
        Ty::F32,
    )
}

/// Threads in a workgroup of either attention kernel, and the positions
/// `attend_part.cu` scores at a time (`THREADS`, `TILE`).
const ATTEND_THREADS: usize = 128;
const ATTEND_TILE: usize = 128;
/// The most splits of a row's positions (`MAX_SPLITS` in `attend_merge.cu`)
/// and of query heads a KV head may have (`MAX_GROUP`).
const ATTEND_MAX_SPLITS: usize = 64;
const ATTEND_MAX_GROUP: usize = 8;
/// Workgroups the first kernel is given when a row's positions reach the
/// whole context: about two an SM of an H100 or H200.
const ATTEND_WORKGROUPS: usize = 264;

/// The query heads one workgroup of `attend_part.cu` takes of a KV head's
/// `group` over caches of `context` positions: up to 2,048 positions two
/// where the group is even, else one; beyond, the whole group. On an H100
/// (`scripts/attend_kernel_bench.cu`, 2026-12-06, µs a layer's attention):
/// at 640 positions two heads took 8.2-11.8 µs at TinyLlama's shape (group
/// 8) where the whole group took 11.5-15.5, since at a short row's few
/// positions only a handful of workgroups have anything to do, each with
/// the group's sums one after the other; at Llama-3.1-8B's 8,192 (group 4),
/// where a long row's splits already fill the GPU, two heads read the
/// caches twice and took 59.1 µs at the last position where the group took
/// 43.8.
pub fn attention_group_heads(group: usize, context: usize) -> usize {
    match context > ATTEND_FEW_HEADS_CONTEXT {
        true => group,
        false if group.is_multiple_of(2) => 2,
        false => 1,
    }
}

/// The longest context at which a workgroup takes fewer than its KV head's
/// whole group ([`attention_group_heads`]).
const ATTEND_FEW_HEADS_CONTEXT: usize = 2048;

/// Whether [`decode_attention`] takes heads of width `d`, `group` query
/// heads a KV head, caches of `storage` elements and `context` positions
/// (each value row's positions start 16-byte aligned).
pub fn decode_attention_fits(d: usize, group: usize, storage: Ty, context: usize) -> bool {
    matches!(d, 64 | 128)
        && (1..=ATTEND_MAX_GROUP).contains(&group)
        && storage == Ty::F16
        && context.is_multiple_of(8)
}

/// How [`decode_attention`] cuts each row's positions: the positions a
/// split takes (a whole number of tiles) and the splits of the context.
/// Splits enough for [`ATTEND_WORKGROUPS`] over all rows and KV heads, no
/// more than the tiles of the context or [`ATTEND_MAX_SPLITS`]. One split
/// (a context of one tile, or rows enough to fill the GPU) is one pass:
/// the first kernel writes the output and no merge runs. Not more often:
/// on an H100 (2026-12-07, `scripts/attend_kernel_bench.cu`) one pass over
/// a whole 640-position context took 4.9 µs a TinyLlama layer at position
/// 16 where five splits and their merge took 8.0, but 14.2 at position 272
/// and 25.3 at 639 (11.6 and 11.3 split): about 5 µs a tile walked one
/// after the other.
pub fn attention_splits(rows: usize, kv_heads: usize, context: usize) -> (usize, usize) {
    let tiles = context.div_ceil(ATTEND_TILE);
    let wanted = ATTEND_WORKGROUPS.div_ceil(rows * kv_heads);
    let splits = wanted.clamp(1, tiles.min(ATTEND_MAX_SPLITS));
    let chunk = tiles.div_ceil(splits) * ATTEND_TILE;
    (chunk, context.div_ceil(chunk))
}

/// The caches a decode step attends to: keys `[layers, slots, kv, context,
/// d]` and values `[layers, slots, kv, d, context]` (f16; without the slots
/// dimension for one sequence), and which layer.
pub struct DecodeCaches<'a> {
    pub keys: &'a Val,
    pub values: &'a Val,
    pub layer: usize,
}

/// Attention of one query row per slot, f16 `q` `[rows, heads, d]` (row r
/// is slot r), to slot r's keys and values at positions
/// `0..=positions[r]` (`[rows]` i32, on the device) of `caches`' layer:
/// `[rows, heads · d]` of `out` (f32, or f16 for a product that takes f16
/// rows: no kernel of its own then rounds them), head h against KV head h
/// / group. kiln's
/// kernels: split-K attention over the positions each row has, and the
/// splits' merge, or at short contexts the first alone in one pass
/// ([`attention_splits`]). IREE's path (q·K, the masked softmax and p·V over the
/// whole context) is what it replaces. Needs [`decode_attention_fits`].
pub fn decode_attention(
    f: &mut Function,
    q: &Val,
    caches: &DecodeCaches,
    positions: &Val,
    out: Ty,
) -> Val {
    assert!(
        matches!(out, Ty::F32 | Ty::F16),
        "decode_attention: {out:?} out"
    );
    let out_half = u32::from(out == Ty::F16);
    let (rows, heads, d) = (q.shape[0], q.shape[1], q.shape[2]);
    let k = &caches.keys.shape;
    // With or without the slots dimension.
    let (slots, kv_heads, context) = match k.len() {
        5 => (k[1], k[2], k[3]),
        4 => (1, k[1], k[2]),
        _ => panic!("decode_attention: keys {k:?}"),
    };
    assert_eq!(k[k.len() - 1], d, "decode_attention: head width");
    assert!(
        caches.layer < k[0],
        "decode_attention: layer {}",
        caches.layer
    );
    assert!(
        rows <= slots,
        "decode_attention: {rows} rows, {slots} slots"
    );
    assert_eq!(positions.shape, [rows], "decode_attention: positions");
    assert!(
        heads.is_multiple_of(kv_heads),
        "decode_attention: {heads} heads"
    );
    let group = heads / kv_heads;
    assert!(
        decode_attention_fits(d, group, q.ty, context) && caches.keys.ty == Ty::F16,
        "decode_attention: d {d}, group {group}, {:?}, context {context}",
        q.ty
    );
    let (chunk, splits) = attention_splits(rows, kv_heads, context);
    let group_heads = attention_group_heads(group, context);
    let q_row_stride = heads * d;
    // One split writes the output itself; more write partials to merge.
    let part_out = match splits {
        1 => vec![rows, heads * d],
        _ => vec![rows * kv_heads * splits * group * (d + 2)],
    };
    let part = f.dispatch_extern(
        &ExternDispatch {
            object: &ATTEND_PART,
            entry: "kiln_attend_part",
            workgroups: rows * kv_heads * (group / group_heads) * splits,
            workgroup_size: ATTEND_THREADS,
            constants: &[
                caches.layer as u32,
                slots as u32,
                kv_heads as u32,
                context as u32,
                chunk as u32,
                splits as u32,
                q_row_stride as u32,
                d as u32,
                group as u32,
                group_heads as u32,
                out_half,
            ],
        },
        &[q, caches.keys, caches.values, positions],
        &part_out,
        if splits == 1 { out } else { Ty::F32 },
    );
    if splits == 1 {
        return part;
    }
    f.dispatch_extern(
        &ExternDispatch {
            object: &ATTEND_MERGE,
            entry: "kiln_attend_merge",
            workgroups: rows * kv_heads,
            workgroup_size: ATTEND_THREADS,
            constants: &[
                kv_heads as u32,
                context as u32,
                chunk as u32,
                splits as u32,
                d as u32,
                group as u32,
                out_half,
            ],
        },
        &[&part, positions],
        &[rows, heads * d],
        out,
    )
}

/// Threads in a workgroup of [`ROPE_APPEND`] (`THREADS`): one a pair of a
/// head's rotated elements, and one a value of a KV head.
const ROPE_THREADS: usize = 128;

/// Whether [`rope_append`] takes heads of width `d` into caches of
/// `storage` elements.
pub fn rope_append_fits(d: usize, storage: Ty) -> bool {
    d.is_multiple_of(2) && d <= ROPE_THREADS && storage == Ty::F16
}

/// A decode step's rotary embedding and cache append in one kernel
/// ([`ROPE_APPEND`]), where IREE's graph runs three (the rotation and a
/// scatter into each cache): `qkv` `[rows, (heads + 2 kv) · d]` f32 (row r
/// is slot r at `positions[r]`, `[rows]` i32), rounded to f16, q and k
/// rotated with `cos` and `sin` (`[context, d / 2]` f32) at the row's
/// position; k and v written into `caches`' layer in place. Returns the
/// rotated queries `[rows, heads, d]` f16 and the updated keys and values.
/// Needs [`rope_append_fits`].
pub fn rope_append(
    f: &mut Function,
    qkv: &Val,
    [cos, sin]: [&Val; 2],
    positions: &Val,
    caches: &DecodeCaches,
    heads: usize,
) -> (Val, Val, Val) {
    let k = &caches.keys.shape;
    let (slots, kv_heads, context, d) = match k.len() {
        5 => (k[1], k[2], k[3], k[4]),
        4 => (1, k[1], k[2], k[3]),
        _ => panic!("rope_append: keys {k:?}"),
    };
    let rows = positions.shape[0];
    assert!(
        rope_append_fits(d, caches.keys.ty) && caches.values.ty == caches.keys.ty,
        "rope_append: d {d}, {:?}",
        caches.keys.ty
    );
    assert!(
        rows <= slots && caches.layer < k[0],
        "rope_append: rows {rows}, layer {}",
        caches.layer
    );
    assert_eq!(
        (&qkv.shape[..], qkv.ty),
        (&[rows, (heads + 2 * kv_heads) * d][..], Ty::F32),
        "rope_append: projections"
    );
    assert_eq!(cos.shape, [context, d / 2], "rope_append: cos table");
    assert_eq!(sin.shape, [context, d / 2], "rope_append: sin table");
    assert_eq!(positions.ty, Ty::I32, "rope_append: positions");
    let results = f.dispatch_extern_results(
        &ExternDispatch {
            object: &ROPE_APPEND,
            entry: "kiln_rope_append",
            workgroups: rows * (heads + kv_heads),
            workgroup_size: ROPE_THREADS,
            constants: &[
                caches.layer as u32,
                slots as u32,
                heads as u32,
                kv_heads as u32,
                context as u32,
                d as u32,
            ],
        },
        &[qkv, cos, sin, positions, caches.keys, caches.values],
        &[
            ExternResult::Tied(4),
            ExternResult::Tied(5),
            ExternResult::New(&[rows, heads, d], Ty::F16),
        ],
    );
    let [keys, values, q]: [Val; 3] = results.try_into().expect("three results");
    (q, keys, values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host build of a kernel's arithmetic (`kernels/NAME.cpp`), run on
    /// bytes in and f32s out.
    struct HostBuild {
        _dir: tempfile::TempDir,
        exe: std::path::PathBuf,
    }

    impl HostBuild {
        /// Compiles `kernels/{name}.cpp` with the host's C++ compiler (`CXX`,
        /// default `c++`) at `standard`, warnings as errors and no
        /// contraction of a product and a sum the source did not write.
        fn new(name: &str, standard: &str) -> HostBuild {
            let dir = tempfile::tempdir().unwrap();
            let exe = dir.path().join(name);
            let source = format!("{}/kernels/{name}.cpp", env!("CARGO_MANIFEST_DIR"));
            let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
            let status = std::process::Command::new(&compiler)
                .args(["-O2", &format!("-std={standard}"), "-pthread"])
                .args([
                    "-ffp-contract=off",
                    "-Wall",
                    "-Werror",
                    "-Wno-unknown-pragmas",
                ])
                .arg("-o")
                .arg(&exe)
                .arg(&source)
                .status()
                .unwrap_or_else(|e| panic!("cannot run the C++ compiler {compiler}: {e}"));
            assert!(status.success(), "{compiler} failed on {source}");
            HostBuild { _dir: dir, exe }
        }

        /// The build run on `input` (its stdin): its stdout as f32s.
        fn run(&self, input: &[u8]) -> Vec<f32> {
            self.run_bytes(input)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        }

        /// The build run on `input`: its stdout.
        fn run_bytes(&self, input: &[u8]) -> Vec<u8> {
            use std::io::Write;
            use std::process::{Command, Stdio};
            let mut child = Command::new(&self.exe)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(input).unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "{:?}", out.status);
            out.stdout
        }
    }

    /// Values uniform in `[-scale, scale)` from a xorshift of `seed`: the
    /// same inputs every run.
    fn uniform(mut seed: u64, scale: f32) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        }
    }

    /// The products of the shapes kiln serves get more than one workgroup
    /// an SM where they have the rows for it, and the most rows a warp
    /// that allows (the choices measured fastest on an H100).
    #[test]
    fn q4_rows_per_warp_keep_the_gpu_busy() {
        // TinyLlama: qkv, o and down, then gate-up and the head.
        assert_eq!(q4_rows_per_warp(2560), 2);
        assert_eq!(q4_rows_per_warp(2048), 1);
        assert_eq!(q4_rows_per_warp(11264), 4);
        assert_eq!(q4_rows_per_warp(32000), 4);
        // Llama-3.1-8B's qkv, then its o and down.
        assert_eq!(q4_rows_per_warp(6144), 4);
        assert_eq!(q4_rows_per_warp(4096), 2);
        // Too few outputs for even one workgroup an SM.
        assert_eq!(q4_rows_per_warp(64), 1);
    }

    /// `kernels/q4_row.cu`'s arithmetic built for the host
    /// (`q4_row_host.cpp`, the GPU instructions as the PTX ISA defines
    /// them, every lane of the grid in turn) against the exact product
    /// within what rounding the row to 16-bit levels allows, at 1, 2 and 4
    /// rows a warp: a last warp with rows past the end, lanes with no block
    /// and lanes with two, blocks of very different magnitudes and of zeros;
    /// plain, with the RMSNorm, and with an MLP's halves in and the residual
    /// out (the down product's fusion) or the residual alone (o's).
    /// The same for `kernels/q8_row.cu` (`q8_row_host.cpp`), the kernel
    /// built for 8-bit blocks, on the same weights in Q8_0 blocks.
    /// The instructions themselves run on a GPU only
    /// (`cuda::q4_kernel_on_the_gpu_matches_the_reference`,
    /// `cuda::q8_weights_on_the_gpu_match_the_reference_on_their_dequantized_weights`).
    #[test]
    fn q4_row_arithmetic_on_the_host_is_within_the_rows_rounding() {
        row_arithmetic_on_the_host(false);
    }

    #[test]
    fn q8_row_arithmetic_on_the_host_is_within_the_rows_rounding() {
        row_arithmetic_on_the_host(true);
    }

    fn row_arithmetic_on_the_host(q8: bool) {
        let host = HostBuild::new(if q8 { "q8_row_host" } else { "q4_row_host" }, "c++17");
        for (rows_per_warp, outputs, blocks) in [
            (1, 37, 3),
            (2, 300, 40),
            (4, 300, 40),
            (4, 70, 1),
            (2, 20, 448),
            (1, 9, 449),
            (1, 10, 300),
        ] {
            let (q, x) = crate::q4::row_check::case(outputs, blocks);
            // At 8 bits: the same weights in Q8_0 blocks (the offsets
            // passed, and not read).
            let (values, scales, weights) = match q8 {
                false => (q.quants.clone(), q.scales.clone(), q.dequantize()),
                true => {
                    let q8 = crate::q8::Q8Matrix::quantize(&q.dequantize()).unwrap();
                    let bytes = q8.quants.iter().map(|&v| v as u8).collect();
                    (bytes, q8.scales.clone(), q8.dequantize())
                }
            };
            // Without the norm, then with it (both paths: the shared row's
            // and the per-lane one's 449 blocks).
            // The norm's weights: f16 values from 0.25 to 1.75.
            let weight: Vec<half::f16> = (0..x.len())
                .map(|i| half::f16::from_f32(0.25 + (i % 7) as f32 * 0.25))
                .collect();
            // The up half beside x as the gate, and a residual of the
            // outputs' size.
            let up: Vec<f32> = (0..x.len())
                .map(|i| ((i * 11 % 23) as f32 - 11.0) * 0.125)
                .collect();
            let residual: Vec<f32> = (0..outputs)
                .map(|o| ((o * 37 % 11) as f32 - 5.0) * 0.5)
                .collect();
            for (eps, swiglu) in [(None, false), (Some(1e-5f32), false), (None, true)] {
                let run_with = |add: bool, paired: bool| {
                    let mut input = Vec::new();
                    let eps_bits = eps.map_or(0, f32::to_bits);
                    let flags = u32::from(swiglu) * Q4_ROW_SWIGLU
                        + u32::from(add) * Q4_ROW_RESIDUAL
                        + u32::from(paired) * Q4_ROW_PAIRED_SWIGLU;
                    for v in [
                        rows_per_warp,
                        outputs as u32,
                        blocks as u32,
                        eps_bits,
                        flags,
                    ] {
                        input.extend(v.to_le_bytes());
                    }
                    input.extend(&values);
                    for v in scales.iter().chain(&q.offsets) {
                        input.extend(v.to_bits().to_le_bytes());
                    }
                    let halves: &[&[f32]] = if swiglu { &[&x, &up] } else { &[&x] };
                    for v in halves.iter().copied().flatten() {
                        input.extend(v.to_le_bytes());
                    }
                    if eps.is_some() {
                        for w in &weight {
                            input.extend(w.to_bits().to_le_bytes());
                        }
                    }
                    if add {
                        for v in &residual {
                            input.extend(v.to_le_bytes());
                        }
                    }
                    let got = host.run(&input);
                    assert_eq!(got.len(), if paired { outputs / 2 } else { outputs });
                    got
                };
                let run = |add: bool| run_with(add, false);
                let got = run(false);
                // An MLP's gate/up product with its rows in pairs (a warp
                // holds both rows of a pair): each pair's output is
                // SiLU(gate) · up of the two outputs the plain product
                // gives, within SiLU's rounding.
                if rows_per_warp % 2 == 0 && outputs % 2 == 0 && !swiglu {
                    let paired = run_with(false, true);
                    for (j, (h, pair)) in paired.iter().zip(got.chunks_exact(2)).enumerate() {
                        let g = pair[0] as f64;
                        let want = g / (1.0 + (-g).exp()) * pair[1] as f64;
                        assert!(
                            (*h as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                            "pair {j}: {h} against SiLU({}) · {} = {want}",
                            pair[0],
                            pair[1]
                        );
                    }
                }
                // With the residual, each output is the residual plus the
                // same output without it, rounded once: the sum the graph
                // would have made.
                for (o, ((y, r), with)) in got.iter().zip(&residual).zip(run(true)).enumerate() {
                    assert_eq!(
                        with.to_bits(),
                        (r + y).to_bits(),
                        "output {o}: {with} against {r} + {y}"
                    );
                }
                // With the norm, the outputs over the exact 1/rms must be the
                // product: a missing or wrong factor is far beyond the rounding.
                let inv_rms = eps.map_or(1.0, |eps| {
                    let mean = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
                    1.0 / (mean + eps as f64).sqrt()
                });
                let unscaled: Vec<f32> = got.iter().map(|&y| (y as f64 / inv_rms) as f32).collect();
                // The row the product is of: x times the norm's weight, or
                // SiLU(x) · up.
                let weighted: Vec<f32> = match (eps, swiglu) {
                    (Some(_), _) => x
                        .iter()
                        .zip(&weight)
                        .map(|(&v, w)| v * w.to_f32())
                        .collect(),
                    (None, true) => x
                        .iter()
                        .zip(&up)
                        .map(|(&g, &u)| {
                            let g = g as f64;
                            (g / (1.0 + (-g).exp()) * u as f64) as f32
                        })
                        .collect(),
                    (None, false) => x.clone(),
                };
                // LEVELS in the source.
                let worst =
                    crate::q4::row_check::worst_error(&weights, &weighted, &unscaled, 32767.0);
                println!(
                    "q8 {q8}, {rows_per_warp} rows a warp, {outputs}x{blocks} blocks, eps {eps:?}, \
                     swiglu {swiglu}: worst {worst:e}"
                );
            }
        }
    }

    /// `kernels/attend_part.cu` and `attend_merge.cu` built for the host
    /// (`attend_host.cpp`: every workgroup's 128 threads as threads, its
    /// barrier and the warps' shuffles as barriers) against attention in
    /// f64 over the same f16 values: one sequence's caches and slots'
    /// caches, heads of 64 and 128, groups of 1, 2, 3, 4 and 8, one pass
    /// over one tile and over two, splits of one tile and of several (the
    /// running max and total carried between tiles), a row with no
    /// position (-1: zeros), positions 0, within a tile, at a tile's end and at the
    /// context's last; the cache past each row's position holds NaN, which
    /// must not be read, as must not the partials of splits past it.
    #[test]
    fn decode_attention_on_the_host_matches_attention_in_f64() {
        let host = HostBuild::new("attend_host", "c++20");
        let mut random = uniform(0x2545_f491_4f6c_dd1d, 1.0);
        /// Rows; slots (0: one sequence's caches, without the dimension);
        /// layers, KV heads, context, head width, group, the layer
        /// attended; each row's position; the output's type.
        struct Case(
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            &'static [i32],
            Ty,
        );
        let cases = [
            Case(1, 0, 2, 2, 640, 64, 8, 1, &[639], Ty::F32),
            Case(3, 4, 1, 2, 264, 128, 4, 0, &[0, 200, 127], Ty::F32),
            // One pass (one split, no merge): a context of one tile, and
            // rows enough that a workgroup walks two tiles; rows with no
            // position.
            Case(3, 3, 1, 2, 128, 64, 2, 0, &[127, -1, 5], Ty::F16),
            Case(3, 3, 1, 2, 128, 128, 4, 0, &[127, 0, -1], Ty::F32),
            Case(
                33,
                33,
                1,
                8,
                256,
                64,
                1,
                0,
                &[
                    255, -1, 128, 127, 0, 200, 255, 17, 255, 100, 255, 3, 255, 64, 255, 129, 255,
                    31, 255, 250, 255, 1, 255, 190, 255, 77, 255, 160, 255, 2, 255, 222, 254,
                ],
                Ty::F16,
            ),
            Case(2, 2, 2, 1, 2048, 64, 3, 1, &[1500, 255], Ty::F16),
            Case(2, 2, 1, 1, 1152, 128, 1, 0, &[-1, 1151], Ty::F32),
            Case(32, 32, 1, 1, 2048, 64, 1, 0, &[2047; 32], Ty::F32),
            // Past 2,048 positions a workgroup takes the whole group.
            Case(1, 0, 1, 2, 2304, 128, 4, 0, &[2300], Ty::F16),
        ];
        for Case(rows, slots, layers, kv, context, d, group, layer, positions, out) in cases {
            let heads = kv * group;
            let s = slots.max(1);
            let (chunk, splits) = attention_splits(rows, kv, context);
            let half = |v: f32| half::f16::from_f32(v);
            let q: Vec<half::f16> = (0..rows * heads * d)
                .map(|_| half(random() * 2.0))
                .collect();
            let cache_len = layers * s * kv * context * d;
            let mut keys: Vec<half::f16> = (0..cache_len).map(|_| half(random() * 2.0)).collect();
            let mut values: Vec<half::f16> = (0..cache_len).map(|_| half(random())).collect();
            // NaN past each row's position, in both caches.
            let base = |r: usize, k: usize| ((layer * s + r) * kv + k) * context * d;
            for (r, &pos) in positions.iter().enumerate() {
                for k in 0..kv {
                    for t in (pos + 1) as usize..context {
                        for j in 0..d {
                            keys[base(r, k) + t * d + j] = half::f16::NAN;
                            values[base(r, k) + j * context + t] = half::f16::NAN;
                        }
                    }
                }
            }
            let mut input = Vec::new();
            let group_heads = attention_group_heads(group, context);
            for v in [
                rows,
                s,
                layers,
                kv,
                context,
                d,
                group,
                layer,
                chunk,
                splits,
                group_heads,
                usize::from(out == Ty::F16),
            ] {
                input.extend((v as u32).to_le_bytes());
            }
            for p in positions {
                input.extend(p.to_le_bytes());
            }
            for v in q.iter().chain(&keys).chain(&values) {
                input.extend(v.to_bits().to_le_bytes());
            }
            let got: Vec<f32> = match out {
                Ty::F16 => host
                    .run_bytes(&input)
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                _ => host.run(&input),
            };
            assert_eq!(got.len(), rows * heads * d);
            // f16 output: within half a unit in the last place of f16 more.
            let rounding = if out == Ty::F16 { 0.5f64.powi(11) } else { 0.0 };
            let mut worst = 0.0f64;
            for (r, &pos) in positions.iter().enumerate() {
                for h in 0..heads {
                    let k = h / group;
                    let qh = &q[(r * heads + h) * d..][..d];
                    // No visible position (-1): zeros.
                    let scores: Vec<f64> = (0..(pos + 1) as usize)
                        .map(|t| {
                            let key = &keys[base(r, k) + t * d..][..d];
                            let dot: f64 = qh
                                .iter()
                                .zip(key)
                                .map(|(a, b)| a.to_f64() * b.to_f64())
                                .sum();
                            dot / (d as f64).sqrt()
                        })
                        .collect();
                    let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for j in 0..d {
                        let sum: f64 = weights
                            .iter()
                            .enumerate()
                            .map(|(t, w)| w * values[base(r, k) + j * context + t].to_f64())
                            .sum();
                        let want = if total > 0.0 { sum / total } else { 0.0 };
                        let error = (got[(r * heads + h) * d + j] as f64 - want).abs();
                        assert!(
                            error.is_finite(),
                            "row {r} head {h} column {j}: {}",
                            got[(r * heads + h) * d + j]
                        );
                        worst = worst.max(error - rounding * want.abs());
                    }
                }
            }
            println!(
                "{rows} rows, {kv}x{group} heads of {d}, {context} positions in {splits} splits of {chunk}, \
                 {out:?} out: worst {worst:e} beyond the output's rounding"
            );
            assert!(worst < 1e-5, "worst error {worst:e}");
        }
    }

    /// `kernels/rope_append.cu` built for the host (`rope_host.cpp`, every
    /// thread of the grid in turn) against the graph's arithmetic: the
    /// projections rounded to f16, rotate-half in f32 with the position's
    /// row of the tables, rounded again; q out, k and v in the caches at the
    /// row's slot and position, bit for bit, and nothing else in the caches
    /// touched (they hold NaN). One sequence's caches and slots' caches,
    /// heads of 64 and 128, a position at the context's end, and one past
    /// it (written nowhere, its q rotated with the last row of the tables).
    #[test]
    fn rope_append_on_the_host_is_the_graphs_arithmetic() {
        use half::f16;
        let host = HostBuild::new("rope_host", "c++20");
        let mut random = uniform(0x9e37_79b9_7f4a_7c15, 4.0);
        /// Rows; slots (0: one sequence's caches); layers, heads, KV heads,
        /// context, head width, the layer; each row's position.
        struct Case(
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            &'static [i32],
        );
        let cases = [
            Case(1, 0, 2, 4, 2, 64, 64, 1, &[17]),
            Case(3, 4, 1, 8, 2, 32, 128, 0, &[0, 31, 5]),
            Case(2, 2, 3, 3, 1, 16, 64, 2, &[16, 15]),
        ];
        for Case(rows, slots, layers, heads, kv, context, d, layer, positions) in cases {
            let s = slots.max(1);
            let half = d / 2;
            let qkv: Vec<f32> = (0..rows * (heads + 2 * kv) * d).map(|_| random()).collect();
            let cos: Vec<f32> = (0..context * half).map(|_| random() / 4.0).collect();
            let sin: Vec<f32> = (0..context * half).map(|_| random() / 4.0).collect();
            let cache = layers * s * kv * context * d;
            let mut input = Vec::new();
            for v in [rows, s, layers, heads, kv, context, d, layer] {
                input.extend((v as u32).to_le_bytes());
            }
            for p in positions {
                input.extend(p.to_le_bytes());
            }
            for v in qkv.iter().chain(&cos).chain(&sin) {
                input.extend(v.to_le_bytes());
            }
            for _ in 0..2 * cache {
                input.extend(f16::NAN.to_bits().to_le_bytes());
            }
            let out = host.run_bytes(&input);
            let halves: Vec<u16> = out
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            assert_eq!(halves.len(), rows * heads * d + 2 * cache);
            let (q, caches) = halves.split_at(rows * heads * d);
            let (keys, values) = caches.split_at(cache);
            let mut written = 0;
            for (r, &pos) in positions.iter().enumerate() {
                let table = (pos as usize).min(context - 1);
                let through = |v: f32| f16::from_f32(v).to_f32();
                let rotated = |head: usize| -> Vec<u16> {
                    let x = &qkv[(r * (heads + 2 * kv) + head) * d..][..d];
                    let mut out = vec![0u16; d];
                    for t in 0..half {
                        let (x1, x2) = (through(x[t]), through(x[t + half]));
                        let (c, s) = (cos[table * half + t], sin[table * half + t]);
                        out[t] = f16::from_f32(x1 * c + x2 * -s).to_bits();
                        out[t + half] = f16::from_f32(x2 * c + x1 * s).to_bits();
                    }
                    out
                };
                for h in 0..heads {
                    assert_eq!(
                        &q[(r * heads + h) * d..][..d],
                        rotated(h),
                        "row {r} q head {h}"
                    );
                }
                if pos as usize >= context {
                    continue;
                }
                for k in 0..kv {
                    let base = ((layer * s + r) * kv + k) * d * context;
                    let key = &keys[base + pos as usize * d..][..d];
                    assert_eq!(key, rotated(heads + k), "row {r} key head {k}");
                    let v = &qkv[(r * (heads + 2 * kv) + heads + kv + k) * d..][..d];
                    for (j, &v) in v.iter().enumerate() {
                        let got = values[base + j * context + pos as usize];
                        assert_eq!(got, f16::from_f32(v).to_bits(), "row {r} value {k}, {j}");
                    }
                    written += 2 * d;
                }
            }
            // Everything else still NaN.
            let untouched = caches
                .iter()
                .filter(|&&h| f16::from_bits(h).is_nan())
                .count();
            assert_eq!(
                untouched,
                2 * cache - written,
                "writes outside the rows' positions"
            );
        }
    }

    /// Each object's PTX has exactly one entry point, the one its
    /// dispatches name (see [`Q4_ROW_ENTRY`]), and declares the PTX version
    /// and target the driver needs.
    #[test]
    fn each_ptx_has_the_one_entry_point() {
        for (object, entry) in [
            (&Q4_ROW, Q4_ROW_ENTRY),
            (&ATTEND_PART, "kiln_attend_part"),
            (&ATTEND_MERGE, "kiln_attend_merge"),
            (&ROPE_APPEND, "kiln_rope_append"),
        ] {
            let entries: Vec<&str> = object
                .ptx
                .lines()
                .filter_map(|line| line.strip_prefix(".visible .entry "))
                .collect();
            assert_eq!(entries, [format!("{entry}(")], "{}", object.name);
            assert!(object.ptx.contains("\n.target sm_80\n"), "{}", object.name);
        }
    }

    /// Splits cover the context in whole tiles, no more of them than the
    /// merge holds, and enough workgroups for the GPU where the context has
    /// the tiles for it; a split past a row's position does no work, so
    /// a long context costs a short row nothing but empty workgroups.
    #[test]
    fn attention_splits_cover_the_context_within_the_merges_limit() {
        for rows in [1, 2, 8, 32] {
            for kv_heads in [1, 3, 4, 8] {
                for context in [8, 120, 640, 2048, 4096, 131_072] {
                    let (chunk, splits) = attention_splits(rows, kv_heads, context);
                    assert!(chunk.is_multiple_of(ATTEND_TILE), "{chunk}");
                    assert!(splits * chunk >= context && (splits - 1) * chunk < context);
                    assert!((1..=ATTEND_MAX_SPLITS).contains(&splits), "{splits}");
                    let tiles = context.div_ceil(ATTEND_TILE);
                    if tiles >= ATTEND_MAX_SPLITS {
                        assert!(
                            rows * kv_heads * splits
                                >= ATTEND_WORKGROUPS.min(rows * kv_heads * ATTEND_MAX_SPLITS) / 2
                        );
                    }
                }
            }
        }
        // TinyLlama's decode step at 640 positions: 5 splits of 128.
        assert_eq!(attention_splits(1, 4, 640), (128, 5));
        // One pass: a context of one tile, or 33 rows of 8 KV heads.
        assert_eq!(attention_splits(1, 8, 128), (128, 1));
        assert_eq!(attention_splits(33, 8, 256), (256, 1));
        // Llama-3.1-8B's at 8,192: 33 splits of 256.
        assert_eq!(attention_splits(1, 8, 8192), (256, 32));
    }
}
