// kiln's C shim over the IREE runtime.
//
// The shim is the only code that includes IREE headers; Rust binds this header
// alone (bindgen), so the FFI surface is a dozen functions on opaque handles
// rather than all of IREE. Every fallible function returns a kiln_iree_error*:
// NULL on success, otherwise an error the caller frees with
// kiln_iree_error_free.
#ifndef KILN_IREE_H_
#define KILN_IREE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_iree_error kiln_iree_error;
typedef struct kiln_iree_instance kiln_iree_instance;
typedef struct kiln_iree_device kiln_iree_device;
typedef struct kiln_iree_module kiln_iree_module;
typedef struct kiln_iree_call kiln_iree_call;
typedef struct kiln_iree_tensor kiln_iree_tensor;
typedef struct kiln_iree_reader kiln_iree_reader;
typedef struct kiln_iree_fence kiln_iree_fence;

// Element types kiln exchanges with modules.
typedef enum kiln_iree_element_type {
  KILN_IREE_F32 = 0,
  KILN_IREE_F16 = 1,
  KILN_IREE_BF16 = 2,
  KILN_IREE_I32 = 3,
  // Signed 4-bit integers, two per byte, element 2k in the low nibble (the
  // packing IREE's modules use for i4 tensors).
  KILN_IREE_I4 = 4,
  // Signed 8-bit integers, one per byte.
  KILN_IREE_I8 = 5,
} kiln_iree_element_type;

// The IREE status code (iree_status_code_t) of an error.
uint32_t kiln_iree_error_code(const kiln_iree_error* error);
// The full message, IREE's annotations included; valid until freed.
const char* kiln_iree_error_message(const kiln_iree_error* error);
void kiln_iree_error_free(kiln_iree_error* error);

// Sets IREE runtime flags, written as IREE's own tools take them
// ("--cuda_use_streams=false"). They are process-wide and configure drivers
// created after the call; an unknown flag is an error. IREE keeps pointers
// into |flags|' strings and writes into them: they must stay valid and
// mutable for the rest of the process. IREE does not check values (atoi) and
// exits the process on action flags (--help): the caller validates first.
// Not thread-safe: the caller serialises it with device creation.
kiln_iree_error* kiln_iree_set_flags(size_t count, char* const* flags);
// Every registered flag with its current value, one per line, as IREE prints
// them ("--name=value"; "# --name..." for list and action flags). Free
// |out_text| with kiln_iree_text_free.
kiln_iree_error* kiln_iree_flags_dump(char** out_text, size_t* out_length);
void kiln_iree_text_free(char* text);

// An instance with every HAL driver compiled into the runtime registered.
kiln_iree_error* kiln_iree_instance_create(kiln_iree_instance** out_instance);
void kiln_iree_instance_release(kiln_iree_instance* instance);
// The registered driver names, separated by '\n', into |buffer| (always
// NUL-terminated when |capacity| > 0); |out_length| gets the full length.
kiln_iree_error* kiln_iree_instance_driver_names(kiln_iree_instance* instance,
                                                 char* buffer, size_t capacity,
                                                 size_t* out_length);

// A device by URI: "local-task", "local-sync", "cuda", "cuda://0", ...
kiln_iree_error* kiln_iree_device_create(kiln_iree_instance* instance,
                                         const char* uri,
                                         kiln_iree_device** out_device);
void kiln_iree_device_release(kiln_iree_device* device);

// Makes |device| rank |rank| of a tensor-parallel world of |count| ranks,
// before any module that uses collectives is loaded on it: the modules'
// default channel (NCCL on CUDA) then joins that world. The ranks meet at
// |rendezvous|, a file path in a folder only this user can enter: for each
// channel (one per module with collectives) rank 0 writes that channel's
// NCCL id to "<rendezvous>.<n>" (mode 0600, whole, by a rename), and the
// other ranks wait for it, up to |timeout_ms|, and read it. A world of one
// needs no rendezvous (NULL).
kiln_iree_error* kiln_iree_device_join_world(kiln_iree_device* device,
                                             int32_t rank, int32_t count,
                                             const char* rendezvous,
                                             uint32_t timeout_ms);

// A session on |device| holding one bytecode module (.vmfb). The bytes are
// copied; the caller may free them on return.
kiln_iree_error* kiln_iree_module_load(kiln_iree_instance* instance,
                                       kiln_iree_device* device,
                                       const uint8_t* data, size_t length,
                                       kiln_iree_module** out_module);
void kiln_iree_module_release(kiln_iree_module* module);
// The address of the module's bytes as IREE holds them (the shim's copy):
// IREE imports constants in place only from 64-byte-aligned memory.
const void* kiln_iree_module_image(const kiln_iree_module* module);

// A call of |function| ("name" or "module.name").
kiln_iree_error* kiln_iree_call_create(kiln_iree_module* module,
                                       const char* function,
                                       kiln_iree_call** out_call);
// Appends a device tensor to the call's inputs (the call holds a reference;
// nothing is copied).
kiln_iree_error* kiln_iree_call_push_tensor(kiln_iree_call* call,
                                            kiln_iree_tensor* tensor);
kiln_iree_error* kiln_iree_call_invoke(kiln_iree_call* call);
// Invokes a function compiled with --iree-execution-model=async-external
// (which takes a wait and a signal fence after its tensors) and returns once
// its work is queued: the work starts after |wait| (NULL: at once) and
// signals |signal| when done. Its outputs may feed later work that waits on
// |signal|; their contents are defined once |signal| is reached.
kiln_iree_error* kiln_iree_call_invoke_async(kiln_iree_call* call,
                                             kiln_iree_fence* wait,
                                             kiln_iree_fence* signal);
// How many outputs the invoked call has left to pop.
size_t kiln_iree_call_output_count(kiln_iree_call* call);
// Takes the next output; it must be a tensor (buffer view).
kiln_iree_error* kiln_iree_call_pop_output(kiln_iree_call* call,
                                           kiln_iree_tensor** out_tensor);
void kiln_iree_call_release(kiln_iree_call* call);

// Copies a dense row-major host tensor into a new tensor on |device|;
// |length| must be the tensor's byte length (an i4 tensor of n elements
// takes (n + 1) / 2 bytes).
kiln_iree_error* kiln_iree_tensor_upload(kiln_iree_device* device,
                                         kiln_iree_element_type type,
                                         const int64_t* shape, size_t rank,
                                         const void* data, size_t length,
                                         kiln_iree_tensor** out_tensor);

// Shape, element type and size of a tensor.
size_t kiln_iree_tensor_rank(const kiln_iree_tensor* tensor);
int64_t kiln_iree_tensor_dim(const kiln_iree_tensor* tensor, size_t index);
kiln_iree_error* kiln_iree_tensor_element_type(const kiln_iree_tensor* tensor,
                                               kiln_iree_element_type* out_type);
size_t kiln_iree_tensor_byte_length(const kiln_iree_tensor* tensor);
// Copies the tensor to host memory; |length| must equal its byte length.
kiln_iree_error* kiln_iree_tensor_read(kiln_iree_tensor* tensor, void* target,
                                       size_t length);
void kiln_iree_tensor_release(kiln_iree_tensor* tensor);

// A reusable host-visible staging buffer for reading tensors of |device|
// back. kiln_iree_tensor_read stages through a buffer allocated and freed
// on every call, which on CUDA is pinned host memory and costs milliseconds;
// a reader allocates once (growing when a larger tensor comes) and copies
// device to staging to host. Not thread-safe: one reader per thread.
kiln_iree_error* kiln_iree_reader_create(kiln_iree_device* device,
                                         kiln_iree_reader** out_reader);
// Copies |tensor| (which must live on the reader's device) into |target|,
// which must be exactly the tensor's byte length.
kiln_iree_error* kiln_iree_reader_read(kiln_iree_reader* reader,
                                       kiln_iree_tensor* tensor, void* target,
                                       size_t length);
// The two halves of a read that overlaps other queued work: _start queues
// the copy of |tensor| into the staging buffer after |after| (NULL: at once)
// and signals |done|; _finish waits for |done| and copies the staging buffer
// into |target| (the tensor's byte length, as given to _start). One read is
// in flight at a time: a read or a second start before _finish is an error.
kiln_iree_error* kiln_iree_reader_start(kiln_iree_reader* reader,
                                        kiln_iree_tensor* tensor,
                                        kiln_iree_fence* after,
                                        kiln_iree_fence* done);
kiln_iree_error* kiln_iree_reader_finish(kiln_iree_reader* reader,
                                         kiln_iree_fence* done, void* target,
                                         size_t length);
void kiln_iree_reader_release(kiln_iree_reader* reader);

// A fence of |device|: one point on a new timeline, reached when the work
// that signals it completes.
kiln_iree_error* kiln_iree_fence_create(kiln_iree_device* device,
                                        kiln_iree_fence** out_fence);
// Blocks until the fence is reached; an error if the work that signals it
// failed.
kiln_iree_error* kiln_iree_fence_wait(kiln_iree_fence* fence);
void kiln_iree_fence_release(kiln_iree_fence* fence);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KILN_IREE_H_
