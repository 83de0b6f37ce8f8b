// kiln's one-row product of 8-bit block weights (GGUF's Q8_0,
// crates/kiln-xla/src/q8.rs) on NVIDIA GPUs:
//
//   y[o] = Σ_b Σ_i q[o,b,i] · scale[o,b] · x[b,i]
//
// with signed 8-bit q in blocks of 32 inputs. It is q4_row.cu built for
// 8-bit values: the row rounded to 16-bit levels the same way, the same
// fusions (RMSNorm, SiLU(gate) · up, residual), the same layout of warps
// and lanes; a block's values are two 16-byte loads of signed bytes that
// dp2a multiplies as they are, and there are no offsets (their binding is
// not read). The entry point is kiln_q8_row.
#define Q8_ROW
#include "q4_row.cu"
