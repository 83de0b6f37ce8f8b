//! What the kernel tests share: random products and their exact values.

use kiln_core::weights::Matrix;

/// A `height × cols` matrix of values in [-1, 1] and `n` input rows in
/// [-3, 3], from `seed` (xorshift: proptest shrinks the seed, not the data).
pub fn random_product(seed: u64, height: usize, cols: usize, n: usize) -> (Matrix, Vec<f32>) {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 2001) as f32 / 1000.0 - 1.0
    };
    let data = (0..height * cols).map(|_| next()).collect();
    let x = (0..n * cols).map(|_| next() * 3.0).collect();
    (Matrix::new(height, cols, data), x)
}

/// `Σ w·x` of each output row and input row, in f64, `[rows, n]`.
pub fn exact_products(w: &Matrix, x: &[f32]) -> Vec<f64> {
    let n = x.len() / w.cols;
    (0..w.rows)
        .flat_map(|r| (0..n).map(move |i| (r, i)))
        .map(|(r, i)| {
            w.row(r)
                .iter()
                .zip(&x[i * w.cols..][..w.cols])
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum()
        })
        .collect()
}

/// `kernel(first, out)` from the second row writes the rows `got` (from
/// the first) has after the first, and nothing else.
pub fn later_rows_alone(rows: usize, got: &[f32], kernel: &dyn Fn(usize, &mut [f32])) {
    if rows > 1 {
        let n = got.len() / rows;
        let mut tail = vec![0.0; (rows - 1) * n];
        kernel(1, &mut tail);
        assert_eq!(tail, got[n..]);
    }
}
