//! Instances, devices, modules and calls: the safe face of the shim.

use std::ffi::CString;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result, STATUS_NOT_FOUND, STATUS_UNAVAILABLE, StatusCode};
use crate::ffi;
use crate::tensor::{ElementType, Tensor};

/// Takes ownership of a shim error; `Ok` for NULL.
fn check(raw: *mut ffi::kiln_iree_error) -> std::result::Result<(), (StatusCode, String)> {
    let Some(raw) = NonNull::new(raw) else {
        return Ok(());
    };
    // SAFETY: a non-NULL error from the shim is valid until freed, and its
    // message is a NUL-terminated string owned by it; we copy both, then free
    // it exactly once.
    unsafe {
        let code = ffi::kiln_iree_error_code(raw.as_ptr());
        let message = std::ffi::CStr::from_ptr(ffi::kiln_iree_error_message(raw.as_ptr()))
            .to_string_lossy()
            .into_owned();
        ffi::kiln_iree_error_free(raw.as_ptr());
        Err((code, message))
    }
}

fn iree_error((code, message): (StatusCode, String)) -> Error {
    Error::Iree { code, message }
}

fn c_string(what: &'static str, value: &str) -> Result<CString> {
    CString::new(value).map_err(|_| Error::Nul {
        what,
        value: value.to_string(),
    })
}

struct RawInstance(NonNull<ffi::kiln_iree_instance>);

impl Drop for RawInstance {
    fn drop(&mut self) {
        // SAFETY: the handle came from kiln_iree_instance_create and is
        // released once, after every device and module holding it is gone.
        unsafe { ffi::kiln_iree_instance_release(self.0.as_ptr()) }
    }
}

// SAFETY: IREE instances are thread-safe (their driver registry is locked).
unsafe impl Send for RawInstance {}
// SAFETY: as above.
unsafe impl Sync for RawInstance {}

/// An IREE runtime instance with every compiled-in HAL driver registered.
#[derive(Clone)]
pub struct Instance {
    raw: Arc<RawInstance>,
}

impl Instance {
    pub fn new() -> Result<Instance> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; on success it holds a new handle.
        check(unsafe { ffi::kiln_iree_instance_create(&mut raw) }).map_err(iree_error)?;
        let raw = NonNull::new(raw).expect("the shim returns a handle on success");
        Ok(Instance {
            raw: Arc::new(RawInstance(raw)),
        })
    }

    /// The HAL drivers compiled into this runtime (`local-sync`, `cuda`, …).
    pub fn drivers(&self) -> Result<Vec<String>> {
        let mut buffer = vec![0u8; 256];
        loop {
            let mut length = 0usize;
            // SAFETY: the buffer is valid for `buffer.len()` bytes; the shim
            // writes at most that many and reports the full length.
            check(unsafe {
                ffi::kiln_iree_instance_driver_names(
                    self.raw.0.as_ptr(),
                    buffer.as_mut_ptr().cast(),
                    buffer.len(),
                    &mut length,
                )
            })
            .map_err(iree_error)?;
            if length < buffer.len() {
                let text = String::from_utf8_lossy(&buffer[..length]);
                let mut names: Vec<String> = text.lines().map(str::to_string).collect();
                names.sort();
                return Ok(names);
            }
            buffer.resize(length + 1, 0);
        }
    }

    /// Opens a device by URI: `local-task`, `local-sync`, `cuda`, `cuda://0`…
    pub fn device(&self, uri: &str) -> Result<Device> {
        let driver = uri.split_once("://").map_or(uri, |(scheme, _)| scheme);
        let drivers = self.drivers()?;
        if !drivers.iter().any(|d| d == driver) {
            return Err(Error::DriverMissing {
                uri: uri.to_string(),
                driver: driver.to_string(),
                available: drivers.join(", "),
                hint: if driver == "cuda" {
                    "Build kiln with `--features cuda` against a prefix from `cargo xtask iree --cuda` (or in `nix develop`)."
                } else {
                    "The drivers of a build are those of its IREE prefix (nix/pins.json's CMake options)."
                },
            });
        }
        let c_uri = c_string("device URI", uri)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the instance handle is live, the URI is NUL-terminated and
        // `raw` is a valid out-pointer.
        check(unsafe {
            ffi::kiln_iree_device_create(self.raw.0.as_ptr(), c_uri.as_ptr(), &mut raw)
        })
        .map_err(|(code, message)| {
            if code == STATUS_UNAVAILABLE {
                Error::DeviceUnavailable {
                    uri: uri.to_string(),
                    hint: if message.contains("libcuda") {
                        "\nThe CUDA driver loads libcuda.so at run time: install the NVIDIA driver, \
                         or add the folder that holds libcuda.so to LD_LIBRARY_PATH \
                         (NixOS: /run/opengl-driver/lib)."
                    } else {
                        ""
                    },
                    message,
                }
            } else {
                iree_error((code, message))
            }
        })?;
        let raw = NonNull::new(raw).expect("the shim returns a handle on success");
        Ok(Device {
            raw: Arc::new(RawDevice(raw)),
            instance: self.clone(),
            uri: uri.to_string(),
        })
    }
}

struct RawDevice(NonNull<ffi::kiln_iree_device>);

impl Drop for RawDevice {
    fn drop(&mut self) {
        // SAFETY: the handle came from kiln_iree_device_create and is released
        // once; modules hold their own IREE reference to the device.
        unsafe { ffi::kiln_iree_device_release(self.0.as_ptr()) }
    }
}

// SAFETY: IREE HAL devices are thread-safe.
unsafe impl Send for RawDevice {}
// SAFETY: as above.
unsafe impl Sync for RawDevice {}

/// A HAL device of an instance.
#[derive(Clone)]
pub struct Device {
    raw: Arc<RawDevice>,
    instance: Instance,
    uri: String,
}

impl Device {
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Loads a compiled module (`.vmfb` bytes) into a new session on this
    /// device. Malformed bytes are an error, never a crash: IREE verifies the
    /// module before using it.
    pub fn load_module(&self, vmfb: &[u8]) -> Result<Module> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: both handles are live; `vmfb` is valid for its length and is
        // copied before the call returns; `raw` is a valid out-pointer.
        check(unsafe {
            ffi::kiln_iree_module_load(
                self.instance.raw.0.as_ptr(),
                self.raw.0.as_ptr(),
                vmfb.as_ptr(),
                vmfb.len(),
                &mut raw,
            )
        })
        .map_err(iree_error)?;
        let raw = NonNull::new(raw).expect("the shim returns a handle on success");
        Ok(Module {
            raw,
            _device: self.clone(),
        })
    }

    /// Loads a `.vmfb` file.
    pub fn load_module_file(&self, path: &Path) -> Result<Module> {
        let bytes = std::fs::read(path).map_err(|source| Error::ReadModule {
            path: path.to_path_buf(),
            source,
        })?;
        self.load_module(&bytes)
    }
}

/// A loaded module in its own session. Sessions are not thread-safe, so a
/// module can move between threads but not be shared by them.
pub struct Module {
    raw: NonNull<ffi::kiln_iree_module>,
    _device: Device,
}

// SAFETY: a session may be used from any thread, one at a time; `Module` is
// not `Sync`, so calls through `&Module` cannot overlap.
unsafe impl Send for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the handle came from kiln_iree_module_load and is released once.
        unsafe { ffi::kiln_iree_module_release(self.raw.as_ptr()) }
    }
}

/// Releases a call on every exit path.
struct Call(NonNull<ffi::kiln_iree_call>);

impl Drop for Call {
    fn drop(&mut self) {
        // SAFETY: the handle came from kiln_iree_call_create and is released once.
        unsafe { ffi::kiln_iree_call_release(self.0.as_ptr()) }
    }
}

/// Releases an output tensor on every exit path.
struct Output(NonNull<ffi::kiln_iree_tensor>);

impl Drop for Output {
    fn drop(&mut self) {
        // SAFETY: the handle came from kiln_iree_call_pop_output and is released once.
        unsafe { ffi::kiln_iree_tensor_release(self.0.as_ptr()) }
    }
}

impl Module {
    /// Calls `function` with `inputs` and returns its outputs, copied to host.
    pub fn call(&self, function: &str, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let c_function = c_string("function name", function)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the module handle is live, the name is NUL-terminated and
        // `raw` is a valid out-pointer.
        check(unsafe {
            ffi::kiln_iree_call_create(self.raw.as_ptr(), c_function.as_ptr(), &mut raw)
        })
        .map_err(|(code, message)| {
            if code == STATUS_NOT_FOUND {
                Error::FunctionNotFound {
                    function: function.to_string(),
                    message,
                }
            } else {
                iree_error((code, message))
            }
        })?;
        let call = Call(NonNull::new(raw).expect("the shim returns a handle on success"));

        for input in inputs {
            let bytes = input.bytes();
            // SAFETY: the call is live; shape and bytes are valid for their
            // lengths and are copied to the device before the call returns.
            check(unsafe {
                ffi::kiln_iree_call_push_input(
                    call.0.as_ptr(),
                    input.element_type().to_raw(),
                    input.shape().as_ptr(),
                    input.shape().len(),
                    bytes.as_ptr().cast(),
                    bytes.len(),
                )
            })
            .map_err(iree_error)?;
        }
        // SAFETY: the call is live and holds its inputs.
        check(unsafe { ffi::kiln_iree_call_invoke(call.0.as_ptr()) }).map_err(iree_error)?;

        // SAFETY: the call is live.
        let count = unsafe { ffi::kiln_iree_call_output_count(call.0.as_ptr()) };
        (0..count).map(|_| read_output(&call)).collect()
    }
}

fn read_output(call: &Call) -> Result<Tensor> {
    let mut raw = std::ptr::null_mut();
    // SAFETY: the call is live and has outputs left (counted by the caller).
    check(unsafe { ffi::kiln_iree_call_pop_output(call.0.as_ptr(), &mut raw) })
        .map_err(iree_error)?;
    let output = Output(NonNull::new(raw).expect("the shim returns a handle on success"));
    let tensor = output.0.as_ptr();
    let mut raw_type = 0;
    // SAFETY (this block): `tensor` is live until `output` drops; every
    // out-pointer is valid, and the read target has exactly the byte length
    // the tensor reports.
    unsafe {
        check(ffi::kiln_iree_tensor_element_type(tensor, &mut raw_type)).map_err(iree_error)?;
        let rank = ffi::kiln_iree_tensor_rank(tensor);
        let shape: Vec<i64> = (0..rank)
            .map(|i| ffi::kiln_iree_tensor_dim(tensor, i))
            .collect();
        let mut bytes = vec![0u8; ffi::kiln_iree_tensor_byte_length(tensor)];
        check(ffi::kiln_iree_tensor_read(
            tensor,
            bytes.as_mut_ptr().cast(),
            bytes.len(),
        ))
        .map_err(iree_error)?;
        Tensor::from_bytes(shape, ElementType::from_raw(raw_type)?, &bytes)
    }
}
