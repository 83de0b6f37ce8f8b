//! A small builder of StableHLO text: SSA values with static shapes, one
//! method per op kiln uses. It writes the MLIR assembly iree-compile reads
//! (the q4 products are linalg, which iree-compile takes beside StableHLO,
//! and kiln's own kernels are dispatched as HAL externs).

use std::fmt::Write as _;

/// Element types of the values kiln's graphs use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    F32,
    F16,
    BF16,
    I32,
    I1,
    /// Signed 16-bit integers: a row rounded to levels for a q4 product.
    I16,
    /// Bytes: packed 4-bit weights read two values at a time.
    I8,
    /// Signed 4-bit integers: packed weights (see `crate::q4`).
    I4,
}

impl Ty {
    fn mlir(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::F16 => "f16",
            Ty::BF16 => "bf16",
            Ty::I32 => "i32",
            Ty::I1 => "i1",
            Ty::I16 => "i16",
            Ty::I8 => "i8",
            Ty::I4 => "i4",
        }
    }

    /// A literal of this type that MLIR reads back exactly: floats as their
    /// hex bit pattern (rounded to nearest for f16 and bf16), integers in
    /// decimal (`value` must then be integral).
    fn literal(self, value: f64) -> String {
        match self {
            Ty::F32 => format!("0x{:08X}", (value as f32).to_bits()),
            Ty::F16 => format!("0x{:04X}", half::f16::from_f64(value).to_bits()),
            Ty::BF16 => format!("0x{:04X}", half::bf16::from_f64(value).to_bits()),
            Ty::I32 | Ty::I16 | Ty::I8 | Ty::I4 => format!("{}", value as i32),
            Ty::I1 => (value != 0.0).to_string(),
        }
    }
}

/// An SSA value and its tensor type.
#[derive(Clone, Debug)]
pub struct Val {
    name: String,
    pub shape: Vec<usize>,
    pub ty: Ty,
}

impl Val {
    /// `tensor<2x3xf32>`, or `tensor<f32>` for a scalar.
    pub fn mlir_type(&self) -> String {
        tensor_type(&self.shape, self.ty)
    }
}

pub fn tensor_type(shape: &[usize], ty: Ty) -> String {
    let mut text = String::from("tensor<");
    for d in shape {
        let _ = write!(text, "{d}x");
    }
    text.push_str(ty.mlir());
    text.push('>');
    text
}

fn list(values: &[usize]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// One function under construction.
pub struct Function {
    name: String,
    /// Each parameter and its attribute dictionary (`{…}` or empty).
    params: Vec<(Val, String)>,
    body: String,
    next: usize,
    /// Collectives emitted so far (see [`Function::next_channel`]).
    channels: usize,
}

impl Function {
    pub fn new(name: &str) -> Function {
        Function {
            name: name.to_string(),
            params: Vec::new(),
            body: String::new(),
            next: 0,
            channels: 0,
        }
    }

    pub fn param(&mut self, shape: &[usize], ty: Ty) -> Val {
        self.param_with(shape, ty, String::new())
    }

    /// A parameter whose storage IREE reuses for result `result`
    /// (`iree.abi.output`): the caller's buffer is updated in place rather
    /// than a new one allocated and returned. The call also consumes it
    /// (`iree.abi.consume`): without that IREE treats the argument as the
    /// caller's and works on a copy, then copies the result back, four
    /// copies of every cache a decode step (168 MB for the 8B at 640
    /// positions, 369 MB for 32 slots of TinyLlama at 256).
    pub fn param_output(&mut self, shape: &[usize], ty: Ty, result: usize) -> Val {
        self.param_with(
            shape,
            ty,
            format!(" {{iree.abi.consume, iree.abi.output = {result} : index}}"),
        )
    }

    fn param_with(&mut self, shape: &[usize], ty: Ty, attributes: String) -> Val {
        let val = Val {
            name: format!("%arg{}", self.params.len()),
            shape: shape.to_vec(),
            ty,
        };
        self.params.push((val.clone(), attributes));
        val
    }

    /// Emits `%vN = <rhs>` and returns the value.
    fn emit(&mut self, shape: &[usize], ty: Ty, rhs: String) -> Val {
        let name = format!("%v{}", self.next);
        self.next += 1;
        let _ = writeln!(self.body, "    {name} = {rhs}");
        Val {
            name,
            shape: shape.to_vec(),
            ty,
        }
    }

    /// Closes the function with `return`; returns its MLIR text.
    pub fn finish(mut self, results: &[&Val]) -> String {
        let params: Vec<String> = self
            .params
            .iter()
            .map(|(p, attributes)| format!("{}: {}{attributes}", p.name, p.mlir_type()))
            .collect();
        let types: Vec<String> = results.iter().map(|r| r.mlir_type()).collect();
        let names: Vec<&str> = results.iter().map(|r| r.name.as_str()).collect();
        let _ = writeln!(
            self.body,
            "    return {} : {}",
            names.join(", "),
            types.join(", ")
        );
        format!(
            "  func.func @{}({}) -> ({}) {{\n{}  }}\n",
            self.name,
            params.join(", "),
            types.join(", "),
            self.body
        )
    }

    /// A splat constant of `shape` and element type `ty`.
    pub fn constant(&mut self, value: f64, shape: &[usize], ty: Ty) -> Val {
        let tensor = tensor_type(shape, ty);
        let rhs = format!("stablehlo.constant dense<{}> : {tensor}", ty.literal(value));
        self.emit(shape, ty, rhs)
    }

    pub fn constant_i32(&mut self, value: i32, shape: &[usize]) -> Val {
        self.constant(value.into(), shape, Ty::I32)
    }

    /// Elementwise conversion to `ty` (round to nearest even).
    pub fn convert(&mut self, a: &Val, ty: Ty) -> Val {
        if a.ty == ty {
            return a.clone();
        }
        let out = tensor_type(&a.shape, ty);
        let rhs = format!(
            "stablehlo.convert {} : ({}) -> {out}",
            a.name,
            a.mlir_type()
        );
        self.emit(&a.shape, ty, rhs)
    }

    /// An elementwise op on operands of one shape (`add`, `multiply`, …).
    pub fn binary(&mut self, op: &str, a: &Val, b: &Val) -> Val {
        assert_eq!(a.shape, b.shape, "{op}: operand shapes differ");
        let rhs = format!("stablehlo.{op} {}, {} : {}", a.name, b.name, a.mlir_type());
        self.emit(&a.shape, a.ty, rhs)
    }

    /// A one-operand elementwise op (`exponential`, `rsqrt`, `logistic`, …).
    pub fn unary(&mut self, op: &str, a: &Val) -> Val {
        let rhs = format!("stablehlo.{op} {} : {}", a.name, a.mlir_type());
        self.emit(&a.shape, a.ty, rhs)
    }

    pub fn broadcast(&mut self, a: &Val, shape: &[usize], dims: &[usize]) -> Val {
        let out = tensor_type(shape, a.ty);
        let rhs = format!(
            "stablehlo.broadcast_in_dim {}, dims = [{}] : ({}) -> {out}",
            a.name,
            list(dims),
            a.mlir_type()
        );
        self.emit(shape, a.ty, rhs)
    }

    pub fn reshape(&mut self, a: &Val, shape: &[usize]) -> Val {
        assert_eq!(
            a.shape.iter().product::<usize>(),
            shape.iter().product::<usize>(),
            "reshape changes the element count"
        );
        let out = tensor_type(shape, a.ty);
        let rhs = format!(
            "stablehlo.reshape {} : ({}) -> {out}",
            a.name,
            a.mlir_type()
        );
        self.emit(shape, a.ty, rhs)
    }

    pub fn transpose(&mut self, a: &Val, perm: &[usize]) -> Val {
        let shape: Vec<usize> = perm.iter().map(|&p| a.shape[p]).collect();
        let out = tensor_type(&shape, a.ty);
        let rhs = format!(
            "stablehlo.transpose {}, dims = [{}] : ({}) -> {out}",
            a.name,
            list(perm),
            a.mlir_type()
        );
        self.emit(&shape, a.ty, rhs)
    }

    /// `dot_general` accumulating into `result` (f16 or bf16 operands with an
    /// f32 result accumulate in f32); the result is batch dims, then `a`'s
    /// free dims, then `b`'s free dims.
    pub fn dot(
        &mut self,
        a: &Val,
        b: &Val,
        batch: (&[usize], &[usize]),
        contract: (&[usize], &[usize]),
        result: Ty,
    ) -> Val {
        assert_eq!(a.ty, b.ty, "dot_general: operand types differ");
        let mut shape: Vec<usize> = batch.0.iter().map(|&d| a.shape[d]).collect();
        let free = |v: &Val, used: &[usize], out: &mut Vec<usize>| {
            for (d, &n) in v.shape.iter().enumerate() {
                if !used.contains(&d) {
                    out.push(n);
                }
            }
        };
        free(a, &[batch.0, contract.0].concat(), &mut shape);
        free(b, &[batch.1, contract.1].concat(), &mut shape);
        let batching = if batch.0.is_empty() {
            String::new()
        } else {
            format!(
                "batching_dims = [{}] x [{}], ",
                list(batch.0),
                list(batch.1)
            )
        };
        let out = tensor_type(&shape, result);
        let rhs = format!(
            "stablehlo.dot_general {}, {}, {batching}contracting_dims = [{}] x [{}] : ({}, {}) -> {out}",
            a.name,
            b.name,
            list(contract.0),
            list(contract.1),
            a.mlir_type(),
            b.mlir_type()
        );
        self.emit(&shape, result, rhs)
    }

    /// Reduces `dims` away with `add`, `maximum` or `minimum` from `init`.
    pub fn reduce(&mut self, op: &str, a: &Val, dims: &[usize], init: f64) -> Val {
        let init = self.constant(init, &[], a.ty);
        let shape: Vec<usize> = (0..a.shape.len())
            .filter(|d| !dims.contains(d))
            .map(|d| a.shape[d])
            .collect();
        let out = tensor_type(&shape, a.ty);
        let rhs = format!(
            "stablehlo.reduce({} init: {}) applies stablehlo.{op} across dimensions = [{}] : ({}, {}) -> {out}",
            a.name,
            init.name,
            list(dims),
            a.mlir_type(),
            init.mlir_type()
        );
        self.emit(&shape, a.ty, rhs)
    }

    pub fn slice(&mut self, a: &Val, start: &[usize], limit: &[usize]) -> Val {
        let shape: Vec<usize> = start.iter().zip(limit).map(|(s, l)| l - s).collect();
        let ones = vec![1; start.len()];
        let out = tensor_type(&shape, a.ty);
        let rhs = format!(
            "\"stablehlo.slice\"({}) {{start_indices = array<i64: {}>, limit_indices = array<i64: {}>, strides = array<i64: {}>}} : ({}) -> {out}",
            a.name,
            list(start),
            list(limit),
            list(&ones),
            a.mlir_type()
        );
        self.emit(&shape, a.ty, rhs)
    }

    /// A slice of `sizes` starting at run-time indices (scalar i32 values).
    pub fn dynamic_slice(&mut self, a: &Val, indices: &[&Val], sizes: &[usize]) -> Val {
        let names: Vec<&str> = indices.iter().map(|v| v.name.as_str()).collect();
        let types: Vec<String> = indices.iter().map(|v| v.mlir_type()).collect();
        let out = tensor_type(sizes, a.ty);
        let rhs = format!(
            "stablehlo.dynamic_slice {}, {}, sizes = [{}] : ({}, {}) -> {out}",
            a.name,
            names.join(", "),
            list(sizes),
            a.mlir_type(),
            types.join(", ")
        );
        self.emit(sizes, a.ty, rhs)
    }

    pub fn dynamic_update_slice(&mut self, a: &Val, update: &Val, indices: &[&Val]) -> Val {
        let names: Vec<&str> = indices.iter().map(|v| v.name.as_str()).collect();
        let types: Vec<String> = indices.iter().map(|v| v.mlir_type()).collect();
        let rhs = format!(
            "stablehlo.dynamic_update_slice {}, {}, {} : ({}, {}, {}) -> {}",
            a.name,
            update.name,
            names.join(", "),
            a.mlir_type(),
            update.mlir_type(),
            types.join(", "),
            a.mlir_type()
        );
        self.emit(&a.shape.clone(), a.ty, rhs)
    }

    /// Writes `updates` (`[n, window…]`) into `a` at `n` index tuples:
    /// `indices` is `[n, dims.len()]` i32, each tuple addressing `dims` of
    /// `a`, which the window leaves out; the window spans `a`'s other
    /// dimensions whole. The tuples must be distinct; one out of range is
    /// skipped, as StableHLO defines.
    pub fn scatter(&mut self, a: &Val, indices: &Val, updates: &Val, dims: &[usize]) -> Val {
        assert_eq!(a.ty, updates.ty, "scatter: operand types differ");
        assert_eq!(indices.shape, [updates.shape[0], dims.len()]);
        let window: Vec<usize> = (1..updates.shape.len()).collect();
        let element = tensor_type(&[], a.ty);
        let block = self.next;
        let rhs = format!(
            "\"stablehlo.scatter\"({}, {}, {}) ({{\n    ^bb0(%old{block}: {element}, %new{block}: {element}):\n      stablehlo.return %new{block} : {element}\n    }}) {{scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [{}], inserted_window_dims = [{}], scatter_dims_to_operand_dims = [{}], index_vector_dim = 1>, indices_are_sorted = false, unique_indices = true}} : ({}, {}, {}) -> {}",
            a.name,
            indices.name,
            updates.name,
            list(&window),
            list(dims),
            list(dims),
            a.mlir_type(),
            indices.mlir_type(),
            updates.mlir_type(),
            a.mlir_type()
        );
        self.emit(&a.shape.clone(), a.ty, rhs)
    }

    pub fn concatenate(&mut self, values: &[&Val], dim: usize) -> Val {
        let mut shape = values[0].shape.clone();
        shape[dim] = values.iter().map(|v| v.shape[dim]).sum();
        let names: Vec<&str> = values.iter().map(|v| v.name.as_str()).collect();
        let types: Vec<String> = values.iter().map(|v| v.mlir_type()).collect();
        let out = tensor_type(&shape, values[0].ty);
        let rhs = format!(
            "stablehlo.concatenate {}, dim = {dim} : ({}) -> {out}",
            names.join(", "),
            types.join(", ")
        );
        self.emit(&shape, values[0].ty, rhs)
    }

    /// Pads with `value` after the end of each dimension (`high`).
    pub fn pad_high(&mut self, a: &Val, value: f64, high: &[usize]) -> Val {
        let pad = self.constant(value, &[], a.ty);
        let shape: Vec<usize> = a.shape.iter().zip(high).map(|(d, h)| d + h).collect();
        let zeros = vec![0; high.len()];
        let out = tensor_type(&shape, a.ty);
        let rhs = format!(
            "stablehlo.pad {}, {}, low = [{}], high = [{}], interior = [{}] : ({}, {}) -> {out}",
            a.name,
            pad.name,
            list(&zeros),
            list(high),
            list(&zeros),
            a.mlir_type(),
            pad.mlir_type()
        );
        self.emit(&shape, a.ty, rhs)
    }

    /// 0, 1, 2, … along `dim` of an i32 tensor of `shape`.
    pub fn iota(&mut self, shape: &[usize], dim: usize) -> Val {
        let ty = tensor_type(shape, Ty::I32);
        self.emit(shape, Ty::I32, format!("stablehlo.iota dim = {dim} : {ty}"))
    }

    /// Elementwise comparison of i32 tensors (`LE`, `LT`, …), giving i1.
    pub fn compare_i32(&mut self, direction: &str, a: &Val, b: &Val) -> Val {
        self.compare(direction, "SIGNED", a, b)
    }

    /// Elementwise comparison of float tensors (`EQ`, …), giving i1.
    pub fn compare_float(&mut self, direction: &str, a: &Val, b: &Val) -> Val {
        self.compare(direction, "FLOAT", a, b)
    }

    fn compare(&mut self, direction: &str, kind: &str, a: &Val, b: &Val) -> Val {
        assert_eq!(a.shape, b.shape, "compare: operand shapes differ");
        let out = tensor_type(&a.shape, Ty::I1);
        let rhs = format!(
            "stablehlo.compare {direction}, {}, {}, {kind} : ({}, {}) -> {out}",
            a.name,
            b.name,
            a.mlir_type(),
            b.mlir_type()
        );
        self.emit(&a.shape, Ty::I1, rhs)
    }

    pub fn select(&mut self, pred: &Val, on_true: &Val, on_false: &Val) -> Val {
        let rhs = format!(
            "stablehlo.select {}, {}, {} : ({}, {}, {}) -> {}",
            pred.name,
            on_true.name,
            on_false.name,
            pred.mlir_type(),
            on_true.mlir_type(),
            on_false.mlir_type(),
            on_true.mlir_type()
        );
        self.emit(&on_true.shape.clone(), on_true.ty, rhs)
    }

    /// The index of the largest element of a 1-D f32 tensor, as `[1]` i32:
    /// the first such index on ties (as the CPU's argmax), and -1 when the
    /// maximum is NaN. [`argmax_rows`] of one row.
    ///
    /// [`argmax_rows`]: Function::argmax_rows
    pub fn argmax(&mut self, a: &Val) -> Val {
        let row = self.reshape(a, &[1, a.shape[0]]);
        self.argmax_rows(&row)
    }

    /// The argmax of each row of a `[B, N]` f32 tensor, as `[B]` i32, with
    /// [`argmax`]'s ties and NaN rule.
    ///
    /// (Value, index) reductions over groups of 32, repeated until one is
    /// left: 128,256 logits take four (4,008, 126, 4 and 1 winners a row).
    /// IREE's CUDA code gives a variadic reduction one thread an output that
    /// loops over the whole group, so the group must be short and the
    /// outputs many: two stages of 256-wide groups then the 501 winners took
    /// 73 µs of an 8B decode step on an H100 (docs/perf-notes.md), one 1-D
    /// reduction of 32,000 values 0.92 ms on an H200. (A max reduction
    /// followed by a separate index search was miscompiled there: it
    /// returned -1 for finite logits. A max of i64 keys packing value and
    /// index does not compile for CUDA.)
    ///
    /// [`argmax`]: Function::argmax
    pub fn argmax_rows(&mut self, a: &Val) -> Val {
        const GROUP: usize = 32;
        assert_eq!(a.ty, Ty::F32, "argmax takes f32 values");
        let batch = a.shape[0];
        let mut values = a.clone();
        let mut index = self.iota(&a.shape, 1);
        while values.shape[1] > 1 {
            let len = values.shape[1];
            let group = GROUP.min(len);
            let groups = len.div_ceil(group);
            let pad = groups * group - len;
            if pad > 0 {
                // -inf at indices past the end never wins over a real
                // element (ties go to the lower index).
                values = self.pad_high(&values, f64::NEG_INFINITY, &[0, pad]);
                index = self.pad_high(&index, i32::MAX.into(), &[0, pad]);
            }
            let grouped = [batch, groups, group];
            let grouped_values = self.reshape(&values, &grouped);
            let grouped_index = self.reshape(&index, &grouped);
            (values, index) = self.reduce_max_index(&grouped_values, &grouped_index, 2);
        }
        let max = self.reshape(&values, &[batch]);
        let at = self.reshape(&index, &[batch]);
        // NaN won the reduction: say so with -1, which no vocabulary holds.
        let is_nan = self.compare_float("NE", &max, &max);
        let none = self.constant_i32(-1, &[batch]);
        self.select(&is_nan, &none, &at)
    }

    /// Two f32 reductions of `a` and `b` (one shape) over `dims` in one
    /// variadic `stablehlo.reduce`, which IREE makes one kernel: `ops[0]`
    /// of `a` from `inits[0]`, `ops[1]` of `b` from `inits[1]`.
    pub fn reduce_pair(
        &mut self,
        ops: [&str; 2],
        (a, b): (&Val, &Val),
        dims: &[usize],
        inits: [f64; 2],
    ) -> (Val, Val) {
        assert_eq!(a.shape, b.shape, "reduce_pair: operand shapes differ");
        assert!(a.ty == Ty::F32 && b.ty == Ty::F32, "reduce_pair: f32 only");
        let init_a = self.constant(inits[0], &[], Ty::F32);
        let init_b = self.constant(inits[1], &[], Ty::F32);
        let shape: Vec<usize> = (0..a.shape.len())
            .filter(|d| !dims.contains(d))
            .map(|d| a.shape[d])
            .collect();
        let out = tensor_type(&shape, Ty::F32);
        let name = format!("%v{}", self.next);
        self.next += 1;
        let f = "tensor<f32>";
        let p = format!("%rp{}", self.next);
        let _ = write!(
            self.body,
            "    {name}:2 = \"stablehlo.reduce\"({}, {}, {}, {}) ({{\n\
             ^bb0({p}a: {f}, {p}b: {f}, {p}c: {f}, {p}d: {f}):\n\
             {p}x = stablehlo.{} {p}a, {p}c : {f}\n\
             {p}y = stablehlo.{} {p}b, {p}d : {f}\n\
             stablehlo.return {p}x, {p}y : {f}, {f}\n\
             }}) {{dimensions = array<i64: {}>}} : ({}, {}, {f}, {f}) -> ({out}, {out})\n",
            a.name,
            b.name,
            init_a.name,
            init_b.name,
            ops[0],
            ops[1],
            list(dims),
            a.mlir_type(),
            b.mlir_type(),
        );
        let result = |i: usize| Val {
            name: format!("{name}#{i}"),
            shape: shape.clone(),
            ty: Ty::F32,
        };
        (result(0), result(1))
    }

    /// The element-wise sum of `a` over the `ranks` ranks of a
    /// tensor-parallel world (every rank gets the sum): each rank's partial
    /// product meets the others' here. IREE lowers it to a collective on
    /// the device's channel (NCCL on CUDA).
    pub fn all_reduce_sum(&mut self, a: &Val, ranks: usize) -> Val {
        let channel = self.next_channel();
        let s = format!("tensor<{}>", a.ty.mlir());
        let p = format!("%ar{channel}");
        let rhs = format!(
            "\"stablehlo.all_reduce\"({}) ({{\n\
             ^bb0({p}a: {s}, {p}b: {s}):\n\
             {p}s = stablehlo.add {p}a, {p}b : {s}\n\
             stablehlo.return {p}s : {s}\n\
             }}) {{{}}} : ({}) -> {}",
            a.name,
            collective_attributes(channel, ranks),
            a.mlir_type(),
            a.mlir_type()
        );
        self.emit(&a.shape, a.ty, rhs)
    }

    /// The ranks' `a` side by side along `dim`, rank 0's first (every rank
    /// gets the whole).
    pub fn all_gather(&mut self, a: &Val, dim: usize, ranks: usize) -> Val {
        let channel = self.next_channel();
        let mut shape = a.shape.clone();
        shape[dim] *= ranks;
        let rhs = format!(
            "\"stablehlo.all_gather\"({}) {{all_gather_dim = {dim} : i64, {}}} : ({}) -> {}",
            a.name,
            collective_attributes(channel, ranks),
            a.mlir_type(),
            tensor_type(&shape, a.ty)
        );
        self.emit(&shape, a.ty, rhs)
    }

    /// A channel id of its own for each collective of the function.
    fn next_channel(&mut self) -> usize {
        self.channels += 1;
        self.channels
    }

    /// The largest of `values` along `dim` and its `indices` entry: one
    /// variadic reduction (the form JAX emits for argmax). Ties go to the
    /// lower index; NaN wins.
    fn reduce_max_index(&mut self, values: &Val, indices: &Val, dim: usize) -> (Val, Val) {
        let lowest = self.constant(f64::NEG_INFINITY, &[], Ty::F32);
        let first = self.constant_i32(i32::MAX, &[]);
        let shape: Vec<usize> = (0..values.shape.len())
            .filter(|&d| d != dim)
            .map(|d| values.shape[d])
            .collect();
        let (out_v, out_i) = (tensor_type(&shape, Ty::F32), tensor_type(&shape, Ty::I32));
        let name = format!("%v{}", self.next);
        self.next += 1;
        let (f, i, b) = ("tensor<f32>", "tensor<i32>", "tensor<i1>");
        let _ = write!(
            self.body,
            "    {name}:2 = \"stablehlo.reduce\"({}, {}, {}, {}) ({{\n\
             ^bb0(%a: {f}, %ai: {i}, %b: {f}, %bi: {i}):\n\
             %gt = stablehlo.compare GT, %a, %b, FLOAT : ({f}, {f}) -> {b}\n\
             %eq = stablehlo.compare EQ, %a, %b, FLOAT : ({f}, {f}) -> {b}\n\
             %lt = stablehlo.compare LT, %ai, %bi, SIGNED : ({i}, {i}) -> {b}\n\
             %tie = stablehlo.and %eq, %lt : {b}\n\
             %nan = stablehlo.compare NE, %a, %a, FLOAT : ({f}, {f}) -> {b}\n\
             %wins = stablehlo.or %gt, %tie : {b}\n\
             %take = stablehlo.or %wins, %nan : {b}\n\
             %v = stablehlo.select %take, %a, %b : {b}, {f}\n\
             %vi = stablehlo.select %take, %ai, %bi : {b}, {i}\n\
             stablehlo.return %v, %vi : {f}, {i}\n\
             }}) {{dimensions = array<i64: {dim}>}} : ({}, {}, {f}, {i}) -> ({out_v}, {out_i})\n",
            values.name,
            indices.name,
            lowest.name,
            first.name,
            values.mlir_type(),
            indices.mlir_type(),
        );
        let value = Val {
            name: format!("{name}#0"),
            shape: shape.clone(),
            ty: Ty::F32,
        };
        let index = Val {
            name: format!("{name}#1"),
            shape,
            ty: Ty::I32,
        };
        (value, index)
    }

    /// Rows of `table` (`[rows, width]`) picked by `indices` (`[n]` i32).
    pub fn take_rows(&mut self, table: &Val, indices: &Val) -> Val {
        let n = indices.shape[0];
        let width = table.shape[1];
        let column = self.reshape(indices, &[n, 1]);
        let shape = [n, width];
        let out = tensor_type(&shape, table.ty);
        let rhs = format!(
            "\"stablehlo.gather\"({}, {}) {{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, {width}>, indices_are_sorted = false}} : ({}, {}) -> {out}",
            table.name,
            column.name,
            table.mlir_type(),
            column.mlir_type()
        );
        self.emit(&shape, table.ty, rhs)
    }
}

impl Function {
    /// One row times a q4 matrix (see `crate::q4`), `[out]` f32: `Σ
    /// (quants · scale + offset) · x` over each row's blocks, of `quants`
    /// `[out, groups, block]` i4, `scales` and `offsets` `[out, groups]`
    /// f16 and the row `x` `[groups, block]` f16. Written as one
    /// `linalg.generic` (iree-compile takes linalg beside StableHLO) so that
    /// `compilation_info`, the text of an `#iree_codegen.compilation_info`
    /// attribute, sets how the kernel is distributed.
    pub fn q4_row_product(
        &mut self,
        quants: &Val,
        scales: &Val,
        offsets: &Val,
        x: &Val,
        compilation_info: &str,
    ) -> Val {
        let out = quants.shape[0];
        assert_eq!(x.shape, quants.shape[1..], "q4_row_product: row shape");
        assert_eq!(scales.shape, quants.shape[..2], "q4_row_product: scales");
        let result = tensor_type(&[out], Ty::F32);
        let init = self.linalg_zeros(&[out], Ty::F32);
        let attributes = format!(" attrs = {{compilation_info = {compilation_info}}}");
        // Block arguments live in the enclosing function's namespace: a
        // prefix unique to this op keeps them apart from other products'.
        let p = format!("%q4r{}", self.next);
        // The row's values in f32: an f16 row is widened in the body.
        let (x_ty, widen_x, xf) = match x.ty {
            Ty::F32 => ("f32", String::new(), format!("{p}x")),
            _ => (
                "f16",
                format!("{p}xf = arith.extf {p}x : f16 to f32\n"),
                format!("{p}xf"),
            ),
        };
        let rhs = format!(
            "linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, \
             affine_map<(d0, d1, d2) -> (d0, d1)>, affine_map<(d0, d1, d2) -> (d0, d1)>, \
             affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0)>], \
             iterator_types = [\"parallel\", \"reduction\", \"reduction\"]}} \
             ins({}, {}, {}, {} : {}, {}, {}, {}) outs({} : {result}){attributes} {{\n\
             ^bb0({p}q: i4, {p}s: f16, {p}o: f16, {p}x: {x_ty}, {p}acc: f32):\n\
             {p}qf = arith.sitofp {p}q : i4 to f32\n\
             {p}sf = arith.extf {p}s : f16 to f32\n\
             {p}of = arith.extf {p}o : f16 to f32\n\
             {widen_x}\
             {p}scaled = arith.mulf {p}qf, {p}sf : f32\n\
             {p}w = arith.addf {p}scaled, {p}of : f32\n\
             {p}term = arith.mulf {p}w, {xf} : f32\n\
             {p}sum = arith.addf {p}acc, {p}term : f32\n\
             linalg.yield {p}sum : f32\n\
             }} -> {result}",
            quants.name,
            scales.name,
            offsets.name,
            x.name,
            quants.mlir_type(),
            scales.mlir_type(),
            offsets.mlir_type(),
            x.mlir_type(),
            init.name,
        );
        self.emit(&[out], Ty::F32, rhs)
    }

    /// A tensor of zeros made the way a `linalg` op's accumulator is
    /// (`tensor.empty` then `linalg.fill`), for the ops written in linalg.
    fn linalg_zeros(&mut self, shape: &[usize], ty: Ty) -> Val {
        let tensor = tensor_type(shape, ty);
        let element = ty.mlir();
        let empty = self.emit(shape, ty, format!("tensor.empty() : {tensor}"));
        let zero = self.emit(
            &[],
            ty,
            format!("arith.constant {} : {element}", ty.literal(0.0)),
        );
        self.emit(
            shape,
            ty,
            format!(
                "linalg.fill ins({} : {element}) outs({} : {tensor}) -> {tensor}",
                zero.name, empty.name
            ),
        )
    }

    /// `d`'s kernel over `inputs` (bound read-only, in order, then the
    /// result), returning a new `shape` tensor of `ty` (its last binding).
    /// IREE's CUDA driver passes a kernel its bindings' addresses, then
    /// `d.constants`; nothing fuses across the dispatch.
    pub fn dispatch_extern(
        &mut self,
        d: &ExternDispatch,
        inputs: &[&Val],
        shape: &[usize],
        ty: Ty,
    ) -> Val {
        let mut results = self.dispatch_extern_results(d, inputs, &[ExternResult::New(shape, ty)]);
        results.remove(0)
    }

    /// `d`'s kernel over `inputs`, with `results`: new tensors, bound after
    /// the inputs in order, or inputs the kernel writes in place (bound
    /// where they are among the inputs, read-write). IREE ties such a
    /// result to its input's buffer, so a cache updated by the kernel is
    /// not copied.
    pub fn dispatch_extern_results(
        &mut self,
        d: &ExternDispatch,
        inputs: &[&Val],
        results: &[ExternResult],
    ) -> Vec<Val> {
        let p = format!("%ext{}", self.next);
        let _ = writeln!(
            self.body,
            "    {p}w = arith.constant {} : index",
            d.workgroups
        );
        for (i, c) in d.constants.iter().enumerate() {
            let _ = writeln!(self.body, "    {p}c{i} = arith.constant {c} : i32");
        }
        let mut operands: Vec<String> = inputs.iter().map(|v| v.name.clone()).collect();
        let mut types: Vec<String> = inputs.iter().map(|v| v.mlir_type()).collect();
        for i in 0..d.constants.len() {
            operands.push(format!("{p}c{i}"));
            types.push("i32".to_string());
        }
        let tied = |i: usize| {
            results
                .iter()
                .any(|r| matches!(r, ExternResult::Tied(t) if *t == i))
        };
        // `Indirect`: the bindings may come from the call's binding table, so
        // that a module's command buffer is recorded once (memoized) and run
        // with each call's buffers. Without it IREE binds an extern
        // dispatch's buffers directly and records the step's command buffer
        // anew on every call.
        let mut bindings: Vec<&str> = (0..inputs.len())
            .map(|i| match tied(i) {
                true => "#hal.pipeline.binding<storage_buffer, Indirect>",
                false => r#"#hal.pipeline.binding<storage_buffer, "ReadOnly|Indirect">"#,
            })
            .collect();
        let mut vals = Vec::with_capacity(results.len());
        let mut result_types = Vec::with_capacity(results.len());
        let name = format!("%v{}", self.next);
        self.next += 1;
        for (i, r) in results.iter().enumerate() {
            let (shape, ty) = match *r {
                ExternResult::New(shape, ty) => {
                    bindings.push("#hal.pipeline.binding<storage_buffer, Indirect>");
                    result_types.push(tensor_type(shape, ty));
                    (shape.to_vec(), ty)
                }
                ExternResult::Tied(input) => {
                    let v = inputs[input];
                    result_types.push(v.name.clone());
                    (v.shape.clone(), v.ty)
                }
            };
            let name = match results.len() {
                1 => name.clone(),
                _ => format!("{name}#{i}"),
            };
            vals.push(Val { name, shape, ty });
        }
        let (lhs, result_types) = match results.len() {
            1 => (name, result_types.remove(0)),
            n => (
                format!("{name}:{n}"),
                format!("({})", result_types.join(", ")),
            ),
        };
        let _ = writeln!(
            self.body,
            "    {lhs} = hal.dispatch.extern \"{entry}\"[{p}w]({operands}) : ({types}) -> {result_types}\n\
             \x20     count({p}d: !hal.device, {p}n: index) -> (index, index, index) {{\n\
             \x20       {p}one = arith.constant 1 : index\n\
             \x20       hal.return {p}n, {p}one, {p}one : index, index, index\n\
             \x20     }}\n\
             \x20     layout(#hal.pipeline.layout<constants = {constants}, bindings = [{bindings}], flags = Indirect>)\n\
             \x20     objects({{#hal.executable.target<\"cuda\", \"cuda-nvptx-fb\"> ordinal(0) = \
             [#hal.executable.object<{{data = {object}}}>]}})\n\
             \x20     attributes {{workgroup_size = [{size} : index, 1 : index, 1 : index]}}",
            entry = d.entry,
            operands = operands.join(", "),
            types = types.join(", "),
            constants = d.constants.len(),
            bindings = bindings.join(", "),
            object = d.object.reference(),
            size = d.workgroup_size,
        );
        vals
    }

    /// `a` unchanged, but computed in a kernel of its own: IREE fuses no
    /// op across `util.optimization_barrier`.
    pub fn barrier(&mut self, a: &Val) -> Val {
        let rhs = format!("util.optimization_barrier {} : {}", a.name, a.mlir_type());
        self.emit(&a.shape, a.ty, rhs)
    }

    /// Packed i4 values `[..., 2n]` as their bytes `[..., n]` (element 2k
    /// in the low nibble): the same memory, no kernel.
    pub fn i4_as_bytes(&mut self, a: &Val) -> Val {
        assert_eq!(a.ty, Ty::I4, "i4_as_bytes: type");
        let mut shape = a.shape.clone();
        let last = shape.last_mut().expect("i4_as_bytes: a scalar");
        assert!(last.is_multiple_of(2), "i4_as_bytes: an odd last dimension");
        *last /= 2;
        let out = tensor_type(&shape, Ty::I8);
        let rhs = format!(
            "flow.tensor.bitcast {} : {} -> {out}",
            a.name,
            a.mlir_type()
        );
        self.emit(&shape, Ty::I8, rhs)
    }

    /// The integer sums of one q4 row product per block: `bytes` `[out,
    /// blocks, BLOCK / 2]` (two signed 4-bit values each, see
    /// [`Function::i4_as_bytes`]) times a row's i16 levels at even and odd
    /// positions, `even` and `odd` `[blocks, BLOCK / 2]`: `[out, blocks]` i32, `Σ_k lo(byte_k) · even_k + hi(byte_k) · odd_k`. Integer
    /// sums may be reassociated, so IREE's CPU code vectorizes along the
    /// block; the nibbles are unpacked with shifts on bytes, which LLVM does
    /// in vector registers where it does not for i4.
    pub fn q4_block_sums(&mut self, bytes: &Val, even: &Val, odd: &Val) -> Val {
        assert_eq!((bytes.ty, even.ty, odd.ty), (Ty::I8, Ty::I16, Ty::I16));
        assert_eq!(even.shape, bytes.shape[1..], "q4_block_sums: row shape");
        assert_eq!(odd.shape, even.shape, "q4_block_sums: row shape");
        let shape = [bytes.shape[0], bytes.shape[1]];
        let result = tensor_type(&shape, Ty::I32);
        let init = self.linalg_zeros(&shape, Ty::I32);
        // Block arguments live in the enclosing function's namespace.
        let p = format!("%q4s{}", self.next);
        let rhs = format!(
            "linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2) -> (d1, d2)>, \
             affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1, d2)>, \
             affine_map<(d0, d1, d2) -> (d0, d1)>], \
             iterator_types = [\"parallel\", \"parallel\", \"reduction\"]}} \
             ins({}, {}, {} : {}, {}, {}) outs({} : {result}) {{\n\
             ^bb0({p}e: i16, {p}o: i16, {p}w: i8, {p}acc: i32):\n\
             {p}four = arith.constant 4 : i8\n\
             {p}up = arith.shli {p}w, {p}four : i8\n\
             {p}lo = arith.shrsi {p}up, {p}four : i8\n\
             {p}hi = arith.shrsi {p}w, {p}four : i8\n\
             {p}lo32 = arith.extsi {p}lo : i8 to i32\n\
             {p}hi32 = arith.extsi {p}hi : i8 to i32\n\
             {p}e32 = arith.extsi {p}e : i16 to i32\n\
             {p}o32 = arith.extsi {p}o : i16 to i32\n\
             {p}a = arith.muli {p}lo32, {p}e32 : i32\n\
             {p}b = arith.muli {p}hi32, {p}o32 : i32\n\
             {p}ab = arith.addi {p}a, {p}b : i32\n\
             {p}sum = arith.addi {p}acc, {p}ab : i32\n\
             linalg.yield {p}sum : i32\n\
             }} -> {result}",
            even.name,
            odd.name,
            bytes.name,
            even.mlir_type(),
            odd.mlir_type(),
            bytes.mlir_type(),
            init.name,
        );
        self.emit(&shape, Ty::I32, rhs)
    }
}

/// Wraps functions into a module, with those of `objects` they dispatch
/// once each as MLIR resources (the caller knows which kernels exist; this
/// builder only writes text).
/// The attributes of a collective over all `ranks` ranks (one group, the
/// ranks by their global ids), on channel `channel`.
fn collective_attributes(channel: usize, ranks: usize) -> String {
    let ids: Vec<usize> = (0..ranks).collect();
    format!(
        "channel_handle = #stablehlo.channel_handle<handle = {channel}, type = 1>, \
         replica_groups = dense<[[{}]]> : tensor<1x{ranks}xi64>, use_global_device_ids",
        list(&ids)
    )
}

pub fn module(functions: &[String], objects: &[&'static ExternObject]) -> String {
    let body = functions.concat();
    let used: Vec<&ExternObject> = objects
        .iter()
        .copied()
        .filter(|object| body.contains(&object.reference()))
        .collect();
    let mut text = format!("module {{\n{body}}}\n");
    if !used.is_empty() {
        text.push_str("{-#\n  dialect_resources: {\n    builtin: {\n");
        for (i, object) in used.iter().enumerate() {
            // Entries are separated by commas.
            if i > 0 {
                text.push_str(",\n");
            }
            // A blob is its alignment (a little-endian u32), then its bytes.
            let _ = write!(text, "      {}: \"0x01000000", object.name);
            for byte in object.bytes() {
                let _ = write!(text, "{byte:02X}");
            }
            text.push('"');
        }
        text.push('\n');
        text.push_str("    }\n  }\n#-}\n");
    }
    text
}

/// A kernel object of kiln's own: PTX the CUDA driver assembles at load
/// time.
pub struct ExternObject {
    /// Its name among the module's resources.
    pub name: &'static str,
    pub ptx: &'static str,
}

impl ExternObject {
    /// The PTX and the NUL the driver reads it up to.
    fn bytes(&self) -> impl Iterator<Item = u8> {
        self.ptx.bytes().chain([0])
    }

    /// The object as a dispatch names it: its resource.
    fn reference(&self) -> String {
        format!(
            "dense_resource<{}> : vector<{}xi8>",
            self.name,
            self.ptx.len() + 1
        )
    }
}

/// A result of an extern dispatch
/// ([`Function::dispatch_extern_results`]).
pub enum ExternResult<'a> {
    /// A new tensor of this shape and type.
    New(&'a [usize], Ty),
    /// The input of this index, written in place.
    Tied(usize),
}

/// One dispatch of an [`ExternObject`]'s entry point.
pub struct ExternDispatch<'a> {
    pub object: &'static ExternObject,
    pub entry: &'a str,
    /// Workgroups along x (y and z are 1).
    pub workgroups: usize,
    /// Threads a workgroup, along x.
    pub workgroup_size: usize,
    /// 32-bit values after the bindings in the kernel's parameters.
    pub constants: &'a [u32],
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compiler::{Compiler, Target};
    use kiln_iree::{Instance, Tensor};

    /// A CPU module of one function `name` over an f32 `[shape]` parameter
    /// whose i32 result `body` makes.
    fn i32_of_f32(
        name: &str,
        shape: &[usize],
        body: impl FnOnce(&mut Function, &Val) -> Val,
    ) -> Box<dyn Fn(Vec<f32>) -> Vec<i32>> {
        let mut f = Function::new(name);
        let x = f.param(shape, Ty::F32);
        let out = body(&mut f, &x);
        let mlir = module(&[f.finish(&[&out])], &[]);
        let compiler = Compiler::from_env().unwrap_or_else(|e| panic!("{e}"));
        let vmfb = compiler.compile(&mlir, Target::LlvmCpu, &[]).unwrap();
        let device = Instance::new().unwrap().device("local-task").unwrap();
        let module = device.load_module(&vmfb).unwrap();
        let (name, dims) = (
            name.to_string(),
            shape.iter().map(|&d| d as i64).collect::<Vec<_>>(),
        );
        Box::new(move |values| {
            let input = Tensor::f32(&dims, values).unwrap();
            module.call(&name, &[input]).unwrap()[0]
                .as_i32()
                .unwrap()
                .to_vec()
        })
    }

    /// `argmax` on the CPU device: the first of tied maxima across groups
    /// and stages, padding never chosen, NaN reported as -1. 1,100 values
    /// take three stages (35 groups of 32, the last padded; 2; 1).
    #[test]
    fn argmax_takes_the_first_maximum_and_reports_nan() {
        let n = 1100;
        let argmax = i32_of_f32("argmax", &[n], |f, x| f.argmax(x));
        let run = |values: &[f32]| argmax(values.to_vec())[0];
        let mut values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        values[1090] = 5.0;
        values[17] = 5.0;
        assert_eq!(run(&values), 17, "ties go to the first index");
        values[17] = 4.0;
        assert_eq!(run(&values), 1090, "the maximum in the padded group");
        values[40] = 5.0;
        assert_eq!(run(&values), 40, "ties across later stages too");
        values[n - 1] = 6.0;
        assert_eq!(run(&values), n as i32 - 1, "the last value");
        assert_eq!(
            run(&vec![f32::NEG_INFINITY; n]),
            0,
            "padding is never chosen"
        );
        values[100] = f32::NAN;
        assert_eq!(run(&values), -1, "NaN is reported");
    }

    /// `argmax_rows`: each row its own winner, a NaN in one row reported for
    /// that row alone.
    #[test]
    fn argmax_rows_takes_each_rows_maximum() {
        let (rows, n) = (3, 70);
        let argmax = i32_of_f32("argmax_rows", &[rows, n], |f, x| f.argmax_rows(x));
        let mut values: Vec<f32> = (0..rows * n).map(|i| (i as f32 * 0.11).cos()).collect();
        values[5] = 9.0;
        values[n + 69] = 9.0;
        values[2 * n + 33] = 9.0;
        assert_eq!(argmax(values.clone()), [5, 69, 33]);
        values[n + 2] = f32::NAN;
        assert_eq!(argmax(values), [5, -1, 33]);
    }
}
