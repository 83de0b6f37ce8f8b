//! Instances, devices, modules and calls: the safe face of the shim.

use std::ffi::CString;
use std::marker::PhantomData;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use crate::error::{
    Error, Result, STATUS_NOT_FOUND, STATUS_UNAVAILABLE, StatusCode, check, iree_error,
};
use crate::ffi;
use crate::flags;
use crate::tensor::{ElementType, Tensor};

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
        // (The process's instance lives in a static: it is never dropped.)
        unsafe { ffi::kiln_iree_instance_release(self.0.as_ptr()) }
    }
}

// SAFETY: IREE instances are thread-safe (their driver registry is locked).
unsafe impl Send for RawInstance {}
// SAFETY: as above.
unsafe impl Sync for RawInstance {}

/// An IREE runtime instance with every compiled-in HAL driver registered;
/// every `Instance` of a process is the same one (see [`Instance::new`]).
#[derive(Clone)]
pub struct Instance {
    raw: Arc<RawInstance>,
}

impl Instance {
    /// The process's instance, created on first use. One, not one per
    /// call: creating an IREE runtime instance registers the HAL's VM types,
    /// and `iree_vm_instance_register_type` first zeroes the process-wide
    /// type id it then sets, which a module loading on another thread checks
    /// its device against ("ref type mismatch" in `hal.device.query.i64`,
    /// seen in CI while parallel tests made their instances).
    pub fn new() -> Result<Instance> {
        static SHARED: OnceLock<std::result::Result<Arc<RawInstance>, (StatusCode, String)>> =
            OnceLock::new();
        let raw = SHARED.get_or_init(|| {
            let mut raw = std::ptr::null_mut();
            // SAFETY: `raw` is a valid out-pointer; on success it holds a new handle.
            check(unsafe { ffi::kiln_iree_instance_create(&mut raw) })?;
            let raw = NonNull::new(raw).expect("the shim returns a handle on success");
            Ok(Arc::new(RawInstance(raw)))
        });
        match raw {
            Ok(raw) => Ok(Instance { raw: raw.clone() }),
            Err(error) => Err(iree_error(error.clone())),
        }
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
        // Drivers read IREE's flags while creating a device: not while they
        // change (see `set_flags`).
        let mut flag_state = flags::lock();
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
        flag_state.live_devices += 1;
        drop(flag_state);
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
        let mut flag_state = flags::lock();
        // SAFETY: the handle came from kiln_iree_device_create and is released
        // once, after everything of it that Rust holds (modules, tensors,
        // readers keep the `RawDevice` alive).
        unsafe { ffi::kiln_iree_device_release(self.0.as_ptr()) }
        flag_state.live_devices -= 1;
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
            device: self.clone(),
        })
    }

    /// Copies a host tensor into device memory.
    /// A reader for tensors of this device (see [`Reader`]).
    pub fn reader(&self) -> Result<Reader> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: the device handle is live and `raw` a valid out-pointer.
        check(unsafe { ffi::kiln_iree_reader_create(self.raw.0.as_ptr(), &mut raw) })
            .map_err(iree_error)?;
        Ok(Reader {
            raw: NonNull::new(raw).expect("the shim returns a handle on success"),
            device: Arc::clone(&self.raw),
        })
    }

    /// A new fence of this device (see [`Module::invoke_async`]).
    pub fn fence(&self) -> Result<Fence> {
        Fence::new(&self.raw)
    }

    pub fn upload(&self, tensor: &Tensor) -> Result<DeviceTensor> {
        let bytes = tensor.bytes();
        let mut raw = std::ptr::null_mut();
        // SAFETY: the device is live; shape and bytes are valid for their
        // lengths and copied before the call returns; `raw` is a valid
        // out-pointer.
        check(unsafe {
            ffi::kiln_iree_tensor_upload(
                self.raw.0.as_ptr(),
                tensor.element_type().to_raw(),
                tensor.shape().as_ptr(),
                tensor.shape().len(),
                bytes.as_ptr().cast(),
                bytes.len(),
                &mut raw,
            )
        })
        .map_err(iree_error)?;
        Ok(DeviceTensor::new(raw, &self.raw))
    }

    /// Makes this device rank `world.rank` of a tensor-parallel world
    /// before any module with collectives is loaded on it: those modules'
    /// default channel (NCCL on CUDA, which the driver loads from
    /// `libnccl.so` when the channel is made) joins that world.
    pub fn join_world(&self, world: &World) -> Result<()> {
        let rendezvous = match &world.rendezvous {
            Some(path) => Some(c_string("rendezvous path", &path.to_string_lossy())?),
            None => None,
        };
        let timeout_ms = u32::try_from(world.timeout.as_millis()).unwrap_or(u32::MAX);
        // SAFETY: the device is live; the path is NUL-terminated (or null)
        // and copied before the call returns.
        check(unsafe {
            ffi::kiln_iree_device_join_world(
                self.raw.0.as_ptr(),
                world.rank,
                world.count,
                rendezvous.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                timeout_ms,
            )
        })
        .map_err(iree_error)
    }

    /// Loads a `.vmfb` file.
    pub fn load_module_file(&self, path: &Path) -> Result<Module> {
        let bytes = std::fs::read(path).map_err(|error| Error::ReadModule {
            path: path.to_path_buf(),
            error,
        })?;
        self.load_module(&bytes)
    }
}

/// A device's place in a tensor-parallel world (see [`Device::join_world`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    pub rank: i32,
    pub count: i32,
    /// Where rank 0 leaves its NCCL id for the others: a path in a folder
    /// only this user can enter. `None` for a world of one.
    pub rendezvous: Option<std::path::PathBuf>,
    /// How long a rank waits for rank 0's id.
    pub timeout: std::time::Duration,
}

impl World {
    /// A world of one rank: its collectives still go through the device's
    /// channel.
    pub fn alone() -> World {
        World {
            rank: 0,
            count: 1,
            rendezvous: None,
            timeout: std::time::Duration::ZERO,
        }
    }
}

/// A loaded module in its own session. Neither `Send` nor `Sync`: sessions
/// are not thread-safe, and a module's outputs may share buffers with its
/// inputs or its own state, which must stay on one thread with the tensors
/// ([`DeviceTensor`]).
pub struct Module {
    raw: NonNull<ffi::kiln_iree_module>,
    device: Device,
}

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

/// A tensor in device memory: a module's output, or an upload. Passing it to
/// a call copies nothing, so weights and caches stay on the device.
///
/// Neither `Send` nor `Sync`: a call may write into an input's buffer (tied
/// outputs, `iree.abi.output`), and its output then shares that buffer with
/// the input. Reading one tensor while a call writes another that shares its
/// buffer would be a data race, so tensors stay on the thread that made them.
///
/// ```compile_fail
/// fn shared_across_threads<T: Sync>() {}
/// shared_across_threads::<kiln_iree::DeviceTensor>();
/// ```
/// ```compile_fail
/// fn moved_across_threads<T: Send>() {}
/// moved_across_threads::<kiln_iree::DeviceTensor>();
/// ```
pub struct DeviceTensor {
    raw: NonNull<ffi::kiln_iree_tensor>,
    /// Keeps the device alive (and its flags fixed) while the tensor is;
    /// calls and reads check that a tensor is their device's.
    device: Arc<RawDevice>,
    _one_thread: PhantomData<*const ()>,
}

impl DeviceTensor {
    fn new(raw: *mut ffi::kiln_iree_tensor, device: &Arc<RawDevice>) -> DeviceTensor {
        DeviceTensor {
            raw: NonNull::new(raw).expect("the shim returns a handle on success"),
            device: Arc::clone(device),
            _one_thread: PhantomData,
        }
    }
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        // SAFETY: the handle came from the shim and is released once.
        unsafe { ffi::kiln_iree_tensor_release(self.raw.as_ptr()) }
    }
}

impl DeviceTensor {
    pub fn shape(&self) -> Vec<i64> {
        // SAFETY: the handle is live; indices stay below the rank.
        unsafe {
            let rank = ffi::kiln_iree_tensor_rank(self.raw.as_ptr());
            (0..rank)
                .map(|i| ffi::kiln_iree_tensor_dim(self.raw.as_ptr(), i))
                .collect()
        }
    }

    pub fn element_type(&self) -> Result<ElementType> {
        let mut raw_type = 0;
        // SAFETY: the handle is live and the out-pointer valid.
        check(unsafe { ffi::kiln_iree_tensor_element_type(self.raw.as_ptr(), &mut raw_type) })
            .map_err(iree_error)?;
        ElementType::from_raw(raw_type)
    }

    /// Copies the tensor to the host, through a staging buffer allocated
    /// for this call; see [`Reader`] for repeated reads.
    pub fn read(&self) -> Result<Tensor> {
        let ty = self.element_type()?;
        // SAFETY: the handle is live; the target has exactly the byte length
        // the tensor reports.
        let bytes = unsafe {
            let mut bytes = vec![0u8; ffi::kiln_iree_tensor_byte_length(self.raw.as_ptr())];
            check(ffi::kiln_iree_tensor_read(
                self.raw.as_ptr(),
                bytes.as_mut_ptr().cast(),
                bytes.len(),
            ))
            .map_err(iree_error)?;
            bytes
        };
        Tensor::from_bytes(self.shape(), ty, &bytes)
    }
}

/// Reads device tensors back through one reusable host-visible staging
/// buffer. [`DeviceTensor::read`] stages through a buffer IREE allocates and
/// frees on every call — pinned host memory on CUDA, milliseconds each — so
/// anything that reads every step (a decode loop) should hold a reader.
pub struct Reader {
    raw: NonNull<ffi::kiln_iree_reader>,
    /// Keeps the device (and its instance) alive while the reader is.
    device: Arc<RawDevice>,
}

// SAFETY: the reader is used through `&mut self` only, so never from two
// threads at once; IREE buffers and devices may move between threads.
unsafe impl Send for Reader {}

impl Drop for Reader {
    fn drop(&mut self) {
        // SAFETY: the handle is live and released exactly once.
        unsafe { ffi::kiln_iree_reader_release(self.raw.as_ptr()) }
    }
}

impl Reader {
    /// Copies `tensor` (a tensor of the reader's device) to the host.
    pub fn read(&mut self, tensor: &DeviceTensor) -> Result<Tensor> {
        same_device(tensor, &self.device, "the tensor to read")?;
        let ty = tensor.element_type()?;
        // SAFETY: both handles are live; the target has exactly the byte
        // length the tensor reports.
        let bytes = unsafe {
            let mut bytes = vec![0u8; ffi::kiln_iree_tensor_byte_length(tensor.raw.as_ptr())];
            check(ffi::kiln_iree_reader_read(
                self.raw.as_ptr(),
                tensor.raw.as_ptr(),
                bytes.as_mut_ptr().cast(),
                bytes.len(),
            ))
            .map_err(iree_error)?;
            bytes
        };
        Tensor::from_bytes(tensor.shape(), ty, &bytes)
    }

    /// Queues a copy of `tensor` to the host that starts once `after` is
    /// reached (if given), so that later work can be queued behind it before
    /// the copy is waited for; [`Reader::finish`] waits and returns the
    /// tensor. One read is in flight at a time: until it is finished,
    /// another start or read is an error.
    pub fn start(&mut self, tensor: &DeviceTensor, after: Option<&Fence>) -> Result<PendingRead> {
        // Everything that can fail before the copy is queued: once it is,
        // only `finish` frees the reader.
        same_device(tensor, &self.device, "the tensor to read")?;
        let done = Fence::new(&self.device)?;
        let element_type = tensor.element_type()?;
        let after = Fence::raw_or_null(after);
        // SAFETY: the reader, the tensor and the fences are live.
        check(unsafe {
            ffi::kiln_iree_reader_start(
                self.raw.as_ptr(),
                tensor.raw.as_ptr(),
                after,
                done.raw.as_ptr(),
            )
        })
        .map_err(iree_error)?;
        Ok(PendingRead {
            reader: self.raw.as_ptr() as usize,
            done,
            shape: tensor.shape(),
            element_type,
            // SAFETY: the tensor handle is live.
            length: unsafe { ffi::kiln_iree_tensor_byte_length(tensor.raw.as_ptr()) },
        })
    }

    /// Waits for a read [`Reader::start`] queued and returns its tensor.
    pub fn finish(&mut self, read: PendingRead) -> Result<Tensor> {
        // The shim copies from this reader's staging buffer: a read another
        // reader started would be read from a buffer whose own copy may
        // still be in flight.
        if read.reader != self.raw.as_ptr() as usize {
            return Err(Error::Tensor(
                "this read was started by another Reader; finish it with that one".into(),
            ));
        }
        let mut bytes = vec![0u8; read.length];
        // SAFETY: the reader and the fence are live; the target has the
        // length the read was started with.
        check(unsafe {
            ffi::kiln_iree_reader_finish(
                self.raw.as_ptr(),
                read.done.raw.as_ptr(),
                bytes.as_mut_ptr().cast(),
                bytes.len(),
            )
        })
        .map_err(iree_error)?;
        Tensor::from_bytes(read.shape, read.element_type, &bytes)
    }
}

impl Module {
    /// The largest power of two that divides the address of the module's
    /// bytes as IREE holds them. IREE imports a module's constants in place
    /// only from 64-byte-aligned memory (and copies them otherwise), so the
    /// shim's copy must be at least that aligned.
    pub fn image_alignment(&self) -> usize {
        // SAFETY: the handle is live; the shim only reads a field.
        let address = unsafe { ffi::kiln_iree_module_image(self.raw.as_ptr()) } as usize;
        1 << address.trailing_zeros()
    }

    /// Calls `function` with host tensors and returns its outputs on the host.
    pub fn call(&self, function: &str, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let uploaded = inputs
            .iter()
            .map(|t| self.device.upload(t))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&DeviceTensor> = uploaded.iter().collect();
        self.invoke(function, &refs)?
            .iter()
            .map(DeviceTensor::read)
            .collect()
    }

    /// Calls `function` with tensors already on the device (of this module's
    /// device); the outputs stay there.
    pub fn invoke(&self, function: &str, inputs: &[&DeviceTensor]) -> Result<Vec<DeviceTensor>> {
        let call = self.prepare_call(function, inputs)?;
        // SAFETY: the call is live and holds its inputs.
        check(unsafe { ffi::kiln_iree_call_invoke(call.0.as_ptr()) }).map_err(iree_error)?;
        self.outputs(&call)
    }

    /// Queues a call of `function`, a function compiled with
    /// `--iree-execution-model=async-external`, and returns without waiting
    /// for it: its work starts once `after` is reached (if given) and
    /// signals the returned fence when done. The outputs' contents are
    /// defined only from that fence on: pass them to later work that waits
    /// on it ([`Module::invoke_async`], [`Reader::start`]), or wait for it
    /// ([`Fence::wait`]) before any other use.
    pub fn invoke_async(
        &self,
        function: &str,
        inputs: &[&DeviceTensor],
        after: Option<&Fence>,
    ) -> Result<(Vec<DeviceTensor>, Fence)> {
        let call = self.prepare_call(function, inputs)?;
        let done = self.device.fence()?;
        let after = Fence::raw_or_null(after);
        // SAFETY: the call and both fences are live; the call takes its own
        // references to the fences.
        check(unsafe {
            ffi::kiln_iree_call_invoke_async(call.0.as_ptr(), after, done.raw.as_ptr())
        })
        .map_err(iree_error)?;
        Ok((self.outputs(&call)?, done))
    }

    /// A call of `function` holding `inputs`.
    fn prepare_call(&self, function: &str, inputs: &[&DeviceTensor]) -> Result<Call> {
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
        for (i, input) in inputs.iter().enumerate() {
            same_device(
                input,
                &self.device.raw,
                &format!("input {i} of `{function}`"),
            )?;
            // SAFETY: both handles are live; the call takes its own reference.
            check(unsafe { ffi::kiln_iree_call_push_tensor(call.0.as_ptr(), input.raw.as_ptr()) })
                .map_err(iree_error)?;
        }
        Ok(call)
    }

    /// An invoked call's outputs.
    fn outputs(&self, call: &Call) -> Result<Vec<DeviceTensor>> {
        // SAFETY: the call is live.
        let count = unsafe { ffi::kiln_iree_call_output_count(call.0.as_ptr()) };
        (0..count)
            .map(|_| {
                let mut raw = std::ptr::null_mut();
                // SAFETY: the call is live and has outputs left (counted above).
                check(unsafe { ffi::kiln_iree_call_pop_output(call.0.as_ptr(), &mut raw) })
                    .map_err(iree_error)?;
                Ok(DeviceTensor::new(raw, &self.device.raw))
            })
            .collect()
    }
}

/// A point on a device's timeline, reached when the queued work that
/// signals it completes.
pub struct Fence {
    raw: NonNull<ffi::kiln_iree_fence>,
    /// Keeps the device alive while the fence is.
    _device: Arc<RawDevice>,
}

// SAFETY: IREE fences and semaphores are thread-safe.
unsafe impl Send for Fence {}

impl Drop for Fence {
    fn drop(&mut self) {
        // SAFETY: the handle came from kiln_iree_fence_create and is released
        // once; queued work holds its own references.
        unsafe { ffi::kiln_iree_fence_release(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence").finish_non_exhaustive()
    }
}

impl Fence {
    fn new(device: &Arc<RawDevice>) -> Result<Fence> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: the device handle is live and `raw` a valid out-pointer.
        check(unsafe { ffi::kiln_iree_fence_create(device.0.as_ptr(), &mut raw) })
            .map_err(iree_error)?;
        Ok(Fence {
            raw: NonNull::new(raw).expect("the shim returns a handle on success"),
            _device: Arc::clone(device),
        })
    }

    /// The shim's handle of `fence`, or NULL (nothing to wait for).
    fn raw_or_null(fence: Option<&Fence>) -> *mut ffi::kiln_iree_fence {
        fence.map_or(std::ptr::null_mut(), |f| f.raw.as_ptr())
    }

    /// Blocks until the fence is reached; an error if the work that signals
    /// it failed.
    pub fn wait(&self) -> Result<()> {
        // SAFETY: the handle is live.
        check(unsafe { ffi::kiln_iree_fence_wait(self.raw.as_ptr()) }).map_err(iree_error)
    }
}

/// A read [`Reader::start`] queued; [`Reader::finish`] completes it.
#[must_use = "the reader stays busy until the read is finished"]
#[derive(Debug)]
pub struct PendingRead {
    /// The reader that started it (its handle's address).
    reader: usize,
    done: Fence,
    shape: Vec<i64>,
    element_type: ElementType,
    length: usize,
}

/// An error unless `tensor` lives on `device`: IREE would use another
/// device's buffer as if it were this one's.
fn same_device(tensor: &DeviceTensor, device: &Arc<RawDevice>, what: &str) -> Result<()> {
    if Arc::ptr_eq(&tensor.device, device) {
        Ok(())
    } else {
        Err(Error::Tensor(format!(
            "{what} lives on another device than the one it is used with; upload it to this one"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `Instance::new` gives the one instance: a second IREE runtime
    /// instance would register the HAL's VM types again, racing module
    /// loads on other threads (see [`Instance::new`]).
    #[test]
    fn every_instance_is_the_process_one() {
        let first = Instance::new().unwrap();
        let again = std::thread::spawn(|| Instance::new().unwrap())
            .join()
            .unwrap();
        assert!(Arc::ptr_eq(&first.raw, &again.raw));
    }
}
