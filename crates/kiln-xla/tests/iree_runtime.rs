//! kiln-iree end to end: a small StableHLO module compiled at test time by the
//! pinned iree-compile runs on `local-task` and `local-sync` with exact
//! results, and every way of misusing the runtime is a clear error.
//!
//! Needs `KILN_IREE_PREFIX` (to build) and `KILN_IREE_COMPILE` (to run), as
//! `cargo xtask test` and `nix develop` provide.

use std::sync::OnceLock;

use half::{bf16, f16};
use kiln_iree::{Error, Instance, Tensor};
use kiln_xla::{Compiler, Target};

const MODULE: &str = r#"
module {
  func.func @add(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %a, %b : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
  func.func @matmul(%a: tensor<2x3xf32>, %b: tensor<3x2xf32>) -> tensor<2x2xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0]
        : (tensor<2x3xf32>, tensor<3x2xf32>) -> tensor<2x2xf32>
    return %0 : tensor<2x2xf32>
  }
  func.func @mul_f16(%a: tensor<3xf16>, %b: tensor<3xf16>) -> tensor<3xf16> {
    %0 = stablehlo.multiply %a, %b : tensor<3xf16>
    return %0 : tensor<3xf16>
  }
  func.func @add_bf16(%a: tensor<3xbf16>, %b: tensor<3xbf16>) -> tensor<3xbf16> {
    %0 = stablehlo.add %a, %b : tensor<3xbf16>
    return %0 : tensor<3xbf16>
  }
  func.func @add_i32(%a: tensor<2x2xi32>, %b: tensor<2x2xi32>) -> tensor<2x2xi32> {
    %0 = stablehlo.add %a, %b : tensor<2x2xi32>
    return %0 : tensor<2x2xi32>
  }
  func.func @negate_and_truncate(%a: tensor<3xf32>) -> (tensor<3xf32>, tensor<3xi32>) {
    %0 = stablehlo.negate %a : tensor<3xf32>
    %1 = stablehlo.convert %a : (tensor<3xf32>) -> tensor<3xi32>
    return %0, %1 : tensor<3xf32>, tensor<3xi32>
  }
  func.func @widen_i4(%a: tensor<2x3xi4>) -> (tensor<2x3xi32>, tensor<2x3xi4>) {
    %0 = stablehlo.convert %a : (tensor<2x3xi4>) -> tensor<2x3xi32>
    %1 = stablehlo.negate %a : tensor<2x3xi4>
    return %0, %1 : tensor<2x3xi32>, tensor<2x3xi4>
  }
  func.func @widen_i8(%a: tensor<4xi8>) -> (tensor<4xi32>, tensor<4xi8>) {
    %0 = stablehlo.convert %a : (tensor<4xi8>) -> tensor<4xi32>
    %1 = stablehlo.negate %a : tensor<4xi8>
    return %0, %1 : tensor<4xi32>, tensor<4xi8>
  }
}
"#;

/// The module, compiled once for the whole test binary.
fn vmfb() -> &'static [u8] {
    static VMFB: OnceLock<Vec<u8>> = OnceLock::new();
    VMFB.get_or_init(|| {
        let compiler = Compiler::from_env().unwrap_or_else(|e| panic!("{e}"));
        compiler
            .compile(MODULE, Target::LlvmCpu, &[])
            .unwrap_or_else(|e| panic!("{e}"))
    })
}

fn exact_results_on(uri: &str) {
    let instance = Instance::new().unwrap();
    let device = instance.device(uri).unwrap();
    assert_eq!(device.uri(), uri);
    let module = device.load_module(vmfb()).unwrap();

    let a = Tensor::f32(&[4], vec![1.5, -2.0, 3.25, 1e6]).unwrap();
    let b = Tensor::f32(&[4], vec![0.5, 2.0, -0.25, 1.0]).unwrap();
    let out = module.call("add", &[a, b]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].shape(), &[4]);
    assert_eq!(out[0].as_f32().unwrap(), &[2.0, 0.0, 3.0, 1_000_001.0]);

    let a = Tensor::f32(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let b = Tensor::f32(&[3, 2], vec![7.0, 8.0, 9.0, 10.0, 11.0, 12.0]).unwrap();
    let out = module.call("matmul", &[a, b]).unwrap();
    assert_eq!(out[0].shape(), &[2, 2]);
    assert_eq!(out[0].as_f32().unwrap(), &[58.0, 64.0, 139.0, 154.0]);

    let h = |v: &[f32]| v.iter().copied().map(f16::from_f32).collect::<Vec<_>>();
    let a = Tensor::f16(&[3], h(&[1.5, -2.0, 0.25])).unwrap();
    let b = Tensor::f16(&[3], h(&[2.0, 3.0, 4.0])).unwrap();
    let out = module.call("mul_f16", &[a, b]).unwrap();
    assert_eq!(out[0].as_f16().unwrap(), h(&[3.0, -6.0, 1.0]).as_slice());

    let bh = |v: &[f32]| v.iter().copied().map(bf16::from_f32).collect::<Vec<_>>();
    let a = Tensor::bf16(&[3], bh(&[1.0, 256.0, -0.5])).unwrap();
    let b = Tensor::bf16(&[3], bh(&[2.0, 1.0, 0.25])).unwrap();
    let out = module.call("add_bf16", &[a, b]).unwrap();
    // 256 + 1 rounds to 256 in bf16 (8 bits of mantissa): real bf16 arithmetic.
    assert_eq!(
        out[0].as_bf16().unwrap(),
        bh(&[3.0, 256.0, -0.25]).as_slice()
    );

    let a = Tensor::i32(&[2, 2], vec![1, -2, i32::MAX, 40]).unwrap();
    let b = Tensor::i32(&[2, 2], vec![10, 20, 0, 2]).unwrap();
    let out = module.call("add_i32", &[a, b]).unwrap();
    assert_eq!(out[0].as_i32().unwrap(), &[11, 18, i32::MAX, 42]);

    let a = Tensor::f32(&[3], vec![1.75, -2.5, 3.0]).unwrap();
    let out = module.call("negate_and_truncate", &[a]).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].as_f32().unwrap(), &[-1.75, 2.5, -3.0]);
    assert_eq!(out[1].as_i32().unwrap(), &[1, -2, 3]);

    // Packed signed 4-bit, element 2k in the low nibble: 0x7f holds 0xf
    // (-1) then 0x7 (7). Six elements in three bytes, both ways.
    let a = Tensor::i4_packed(&[2, 3], vec![0x7f, 0x80, 0x21]).unwrap();
    let out = module.call("widen_i4", &[a]).unwrap();
    assert_eq!(out[0].as_i32().unwrap(), &[-1, 7, 0, -8, 1, 2]);
    // Negated: 1, -7, 0, -8 (wraps), -1, -2.
    assert_eq!(
        out[1].data(),
        &kiln_iree::TensorData::I4(vec![0x91, 0x80, 0xef])
    );
    // Signed 8-bit, both ways; -128 negated wraps.
    let a = Tensor::i8(&[4], vec![-128, -1, 0, 127]).unwrap();
    let out = module.call("widen_i8", &[a]).unwrap();
    assert_eq!(out[0].as_i32().unwrap(), &[-128, -1, 0, 127]);
    assert_eq!(
        out[1].data(),
        &kiln_iree::TensorData::I8(vec![-128, 1, 0, -127])
    );
}

#[test]
fn exact_results_on_local_task() {
    exact_results_on("local-task");
}

#[test]
fn exact_results_on_local_sync() {
    exact_results_on("local-sync");
}

/// A reader gives what a one-off read gives, for tensors that grow its
/// staging buffer and for smaller ones after; another device's tensor is an
/// error.
#[test]
fn a_reader_reads_what_read_reads() {
    let instance = Instance::new().unwrap();
    let device = instance.device("local-task").unwrap();
    let mut reader = device.reader().unwrap();
    let tensors = [
        Tensor::i32(&[1], vec![7]).unwrap(),
        Tensor::f32(&[2, 3], vec![1.0, -2.0, 3.5, 4.0, 5.0, f32::MAX]).unwrap(),
        Tensor::f16(&[2], vec![f16::from_f32(0.5), f16::NEG_INFINITY]).unwrap(),
        Tensor::f32(&[0], vec![]).unwrap(),
    ];
    for tensor in tensors {
        let on_device = device.upload(&tensor).unwrap();
        assert_eq!(reader.read(&on_device).unwrap(), tensor);
        assert_eq!(on_device.read().unwrap(), tensor);
    }
    let other = instance.device("local-sync").unwrap();
    let foreign = other.upload(&Tensor::i32(&[1], vec![1]).unwrap()).unwrap();
    let error = reader.read(&foreign).unwrap_err().to_string();
    assert!(error.contains("another device"), "{error}");
}

/// A read is finished by the reader that started it (the shim copies from
/// that reader's staging buffer), and a call takes only its own device's
/// tensors: both were used unchecked, as if they were the right ones.
#[test]
fn reads_and_calls_refuse_another_readers_or_devices_handles() {
    let instance = Instance::new().unwrap();
    let device = instance.device("local-task").unwrap();
    let tensor = Tensor::f32(&[3], vec![1.0, 2.0, 3.0]).unwrap();
    let on_device = device.upload(&tensor).unwrap();
    let (mut first, mut second) = (device.reader().unwrap(), device.reader().unwrap());
    let pending = first.start(&on_device, None).unwrap();
    let error = second.finish(pending).unwrap_err().to_string();
    assert!(error.contains("another Reader"), "{error}");
    let pending = second.start(&on_device, None).unwrap();
    assert_eq!(second.finish(pending).unwrap(), tensor);

    let module = device.load_module(vmfb()).unwrap();
    let other = instance.device("local-sync").unwrap();
    let foreign = other.upload(&tensor).unwrap();
    let error = module
        .invoke("add", &[&on_device, &foreign])
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains("input 1 of `add`") && error.contains("another device"),
        "{error}"
    );
}

#[test]
fn cpu_drivers_are_registered() {
    let drivers = Instance::new().unwrap().drivers().unwrap();
    assert!(drivers.contains(&"local-task".to_string()), "{drivers:?}");
    assert!(drivers.contains(&"local-sync".to_string()), "{drivers:?}");
    assert_eq!(
        drivers.contains(&"cuda".to_string()),
        cfg!(feature = "cuda"),
        "the cuda driver is registered exactly when the cuda feature is on: {drivers:?}"
    );
}

#[test]
fn compiler_revision_matches_the_runtime() {
    let compiler = Compiler::from_env().unwrap();
    assert_eq!(compiler.revision(), kiln_iree::RUNTIME_REVISION);
    assert_eq!(compiler.revision().len(), 40);
}

#[test]
fn truncated_and_garbage_modules_are_errors() {
    let device = Instance::new().unwrap().device("local-sync").unwrap();
    let whole = vmfb();
    for (what, bytes) in [
        ("empty", &[][..]),
        ("first half", &whole[..whole.len() / 2]),
        ("first 64 bytes", &whole[..64]),
        ("garbage", &[0x5a_u8; 4096][..]),
    ] {
        match device.load_module(bytes) {
            Err(Error::Iree { message, .. }) => {
                assert!(!message.is_empty(), "{what}: empty message")
            }
            Err(other) => panic!("{what}: unexpected error kind: {other}"),
            Ok(_) => panic!("{what}: a broken module loaded"),
        }
    }
    // The intact module still loads on the same device afterwards.
    device.load_module(whole).unwrap();
}

#[test]
fn missing_function_is_named() {
    let device = Instance::new().unwrap().device("local-task").unwrap();
    let module = device.load_module(vmfb()).unwrap();
    let a = Tensor::f32(&[4], vec![0.0; 4]).unwrap();
    let error = module.call("no_such_function", &[a]).err().unwrap();
    assert!(
        matches!(&error, Error::FunctionNotFound { function, .. } if function == "no_such_function"),
        "{error}"
    );
    assert!(error.to_string().contains("no_such_function"), "{error}");
}

#[test]
fn mistyped_and_misshaped_inputs_are_errors() {
    let device = Instance::new().unwrap().device("local-task").unwrap();
    let module = device.load_module(vmfb()).unwrap();
    let ints = Tensor::i32(&[4], vec![1, 2, 3, 4]).unwrap();
    let error = module.call("add", &[ints.clone(), ints]).err().unwrap();
    assert!(matches!(error, Error::Iree { .. }), "{error}");
    let short = Tensor::f32(&[3], vec![1.0, 2.0, 3.0]).unwrap();
    let error = module.call("add", &[short.clone(), short]).err().unwrap();
    assert!(matches!(error, Error::Iree { .. }), "{error}");
    let error = module.call("add", &[]).err().unwrap();
    assert!(matches!(error, Error::Iree { .. }), "{error}");
}

/// With the CUDA driver compiled in, a machine without `libcuda.so` gets an
/// error that names the library and what to do.
#[cfg(feature = "cuda")]
#[test]
fn cuda_device_without_libcuda_is_a_clear_error() {
    match Instance::new().unwrap().device("cuda") {
        Ok(_) => {
            println!("skipped the libcuda.so assertion: this machine has a CUDA driver and GPU")
        }
        Err(error @ Error::DeviceUnavailable { .. }) => {
            let text = error.to_string();
            assert!(
                text.contains("libcuda.so"),
                "the error must name libcuda.so: {text}"
            );
            assert!(
                text.contains("LD_LIBRARY_PATH"),
                "the error must say what to do: {text}"
            );
        }
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}

/// Without the `cuda` feature, asking for a CUDA device names the feature.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_device_without_the_cuda_feature_is_a_clear_error() {
    match Instance::new().unwrap().device("cuda") {
        Err(error @ Error::DriverMissing { .. }) => {
            assert!(error.to_string().contains("--features cuda"), "{error}");
        }
        Err(other) => panic!("unexpected error kind: {other}"),
        Ok(_) => panic!("a cuda device opened without the cuda feature"),
    }
}

#[test]
fn unknown_driver_is_a_clear_error() {
    let error = Instance::new().unwrap().device("vulkan").err().unwrap();
    assert!(
        matches!(&error, Error::DriverMissing { driver, .. } if driver == "vulkan"),
        "{error}"
    );
}

/// A module whose image is larger than glibc's mmap threshold: `malloc` hands
/// such blocks out 16 bytes past a page boundary, so only a copy made with
/// 64-byte alignment lets IREE import the constant in place.
#[test]
fn module_image_is_64_byte_aligned_and_its_constant_is_used() {
    const N: usize = 65_536;
    let table: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let hex: String = table
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .map(|b| format!("{b:02X}"))
        .collect();
    let mlir = format!(
        r#"module {{
  func.func @add_table(%x: tensor<{N}xf32>) -> tensor<{N}xf32> {{
    %t = stablehlo.constant dense<"0x{hex}"> : tensor<{N}xf32>
    %0 = stablehlo.add %x, %t : tensor<{N}xf32>
    return %0 : tensor<{N}xf32>
  }}
}}"#
    );
    let compiler = Compiler::from_env().unwrap_or_else(|e| panic!("{e}"));
    let vmfb = compiler
        .compile(&mlir, Target::LlvmCpu, &[])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(vmfb.len() > 256 * 1024, "the module holds the table");

    let instance = Instance::new().unwrap();
    let device = instance.device("local-sync").unwrap();
    let module = device.load_module(&vmfb).unwrap();
    assert!(
        module.image_alignment() >= 64,
        "the module's bytes are only {}-byte aligned",
        module.image_alignment()
    );
    let ones = Tensor::f32(&[N as i64], vec![1.0; N]).unwrap();
    let out = module.call("add_table", &[ones]).unwrap();
    let out = out[0].as_f32().unwrap();
    assert!(out.iter().zip(&table).all(|(o, t)| *o == t + 1.0));
}

/// The module compiled with `--iree-execution-model=async-external`: every
/// function takes a wait and a signal fence after its tensors.
fn async_vmfb() -> &'static [u8] {
    static VMFB: OnceLock<Vec<u8>> = OnceLock::new();
    VMFB.get_or_init(|| {
        let compiler = Compiler::from_env().unwrap_or_else(|e| panic!("{e}"));
        compiler
            .compile(
                MODULE,
                Target::LlvmCpu,
                &["--iree-execution-model=async-external"],
            )
            .unwrap_or_else(|e| panic!("{e}"))
    })
}

/// Asynchronous calls chained on the device, each waiting on the one before,
/// and their result read back through a pending read, as the greedy decode
/// pipeline does; a second read while one is in flight is an error that
/// leaves the first intact.
fn chained_async_calls_on(uri: &str) {
    let instance = Instance::new().unwrap();
    let device = instance.device(uri).unwrap();
    let module = device.load_module(async_vmfb()).unwrap();
    let mut reader = device.reader().unwrap();
    let one = device
        .upload(&Tensor::f32(&[4], vec![1.0, 2.0, 3.0, 4.0]).unwrap())
        .unwrap();
    let mut sum = device
        .upload(&Tensor::f32(&[4], vec![0.5; 4]).unwrap())
        .unwrap();
    let mut after = None;
    for _ in 0..10 {
        let (mut outputs, done) = module
            .invoke_async("add", &[&sum, &one], after.as_ref())
            .unwrap();
        assert_eq!(outputs.len(), 1);
        sum = outputs.pop().unwrap();
        after = Some(done);
    }
    let read = reader.start(&sum, after.as_ref()).unwrap();
    let busy = reader.start(&sum, None).unwrap_err().to_string();
    assert!(busy.contains("in flight"), "{busy}");
    let busy = reader.read(&one).unwrap_err().to_string();
    assert!(busy.contains("in flight"), "{busy}");
    let host = reader.finish(read).unwrap();
    assert_eq!(host.as_f32().unwrap(), &[10.5, 20.5, 30.5, 40.5]);
    // The reader is free again.
    assert_eq!(
        reader.read(&one).unwrap().as_f32().unwrap(),
        &[1.0, 2.0, 3.0, 4.0]
    );
    // A synchronous call of an asynchronous function is an error (it lacks
    // its fences), not a crash.
    assert!(module.invoke("add", &[&sum, &one]).is_err());
}

#[test]
fn chained_async_calls_on_local_task() {
    chained_async_calls_on("local-task");
}

#[test]
fn chained_async_calls_on_local_sync() {
    chained_async_calls_on("local-sync");
}
