// kiln's C shim over the IREE runtime: see kiln_iree.h.
//
// Built by kiln-iree's build script with IREE_ALLOCATOR_SYSTEM_CTL defined, as
// every translation unit that includes iree/runtime/api.h must be.
#include "kiln_iree.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "iree/base/tooling/flags.h"
#include "iree/hal/channel_provider.h"
#include "iree/modules/hal/types.h"
#include "iree/runtime/api.h"

struct kiln_iree_error {
  uint32_t code;
  char* message;
};

struct kiln_iree_instance {
  iree_runtime_instance_t* instance;
};

struct kiln_iree_device {
  iree_hal_device_t* device;
};

struct kiln_iree_module {
  iree_runtime_session_t* session;
  iree_hal_device_t* device;
  const void* image;  // owned by |session|
};

struct kiln_iree_call {
  iree_runtime_call_t call;
  iree_hal_device_t* device;
};

struct kiln_iree_tensor {
  iree_hal_buffer_view_t* view;
  iree_hal_device_t* device;
};

struct kiln_iree_reader {
  iree_hal_device_t* device;
  iree_hal_buffer_t* staging;  // NULL until the first read
  iree_device_size_t capacity;
  // The length of the read kiln_iree_reader_start queued; 0 when none is.
  iree_device_size_t in_flight;
};

struct kiln_iree_fence {
  iree_hal_fence_t* fence;
};

// An error with a plain message (no IREE status behind it).
static kiln_iree_error* kiln_iree_error_new(uint32_t code, const char* context,
                                            const char* detail) {
  kiln_iree_error* error = calloc(1, sizeof(*error));
  if (!error) abort();  // Out of memory while reporting an error.
  size_t length = strlen(context) + strlen(detail) + 3;
  error->message = malloc(length);
  if (!error->message) abort();
  snprintf(error->message, length, "%s: %s", context, detail);
  error->code = code;
  return error;
}

// Converts (and consumes) an IREE status; NULL when it is OK.
static kiln_iree_error* kiln_iree_error_from_status(iree_status_t status,
                                                    const char* context) {
  if (iree_status_is_ok(status)) return NULL;
  uint32_t code = (uint32_t)iree_status_code(status);
  iree_allocator_t allocator = iree_allocator_system();
  char* text = NULL;
  iree_host_size_t text_length = 0;
  kiln_iree_error* error;
  if (iree_status_to_string(status, &allocator, &text, &text_length)) {
    error = kiln_iree_error_new(code, context, text);
    iree_allocator_free(allocator, text);
  } else {
    error = kiln_iree_error_new(code, context,
                                iree_status_code_string(iree_status_code(status)));
  }
  iree_status_free(status);
  return error;
}

uint32_t kiln_iree_error_code(const kiln_iree_error* error) {
  return error->code;
}

const char* kiln_iree_error_message(const kiln_iree_error* error) {
  return error->message;
}

void kiln_iree_error_free(kiln_iree_error* error) {
  if (!error) return;
  free(error->message);
  free(error);
}

kiln_iree_error* kiln_iree_set_flags(size_t count, char* const* flags) {
  // iree_flags_parse takes a mutable argv with the program name first. It
  // keeps pointers into the flag strings themselves (string and list flags)
  // and writes NULs into them, so the caller keeps those alive and mutable
  // for the life of the process; this argv array of pointers is only read
  // during the call.
  char** argv = calloc(count + 2, sizeof(char*));
  if (!argv) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED, "setting flags",
                               "out of memory");
  }
  static char program_name[] = "kiln";
  argv[0] = program_name;
  for (size_t i = 0; i < count; ++i) argv[i + 1] = flags[i];
  int argc = (int)count + 1;
  char** parsed = argv;
  iree_status_t status =
      iree_flags_parse(IREE_FLAGS_PARSE_MODE_DEFAULT, &argc, &parsed);
  // Anything left over was not a flag.
  if (iree_status_is_ok(status) && argc != 1) {
    status = iree_make_status(IREE_STATUS_INVALID_ARGUMENT,
                              "'%s' is not a --name=value flag", parsed[1]);
  }
  free(argv);
  return kiln_iree_error_from_status(status, "setting IREE flags");
}

kiln_iree_error* kiln_iree_flags_dump(char** out_text, size_t* out_length) {
  *out_text = NULL;
  *out_length = 0;
  FILE* file = open_memstream(out_text, out_length);
  if (!file) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "listing IREE flags", "out of memory");
  }
  iree_flags_dump(IREE_FLAG_DUMP_MODE_DEFAULT, file);
  if (fclose(file) != 0) {
    free(*out_text);
    *out_text = NULL;
    *out_length = 0;
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "listing IREE flags", "out of memory");
  }
  return NULL;
}

void kiln_iree_text_free(char* text) { free(text); }

kiln_iree_error* kiln_iree_instance_create(kiln_iree_instance** out_instance) {
  *out_instance = NULL;
  kiln_iree_instance* instance = calloc(1, sizeof(*instance));
  if (!instance) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "creating the IREE instance", "out of memory");
  }
  iree_runtime_instance_options_t options;
  iree_runtime_instance_options_initialize(&options);
  iree_runtime_instance_options_use_all_available_drivers(&options);
  iree_status_t status = iree_runtime_instance_create(
      &options, iree_allocator_system(), &instance->instance);
  if (!iree_status_is_ok(status)) {
    free(instance);
    return kiln_iree_error_from_status(status, "creating the IREE instance");
  }
  *out_instance = instance;
  return NULL;
}

void kiln_iree_instance_release(kiln_iree_instance* instance) {
  if (!instance) return;
  iree_runtime_instance_release(instance->instance);
  free(instance);
}

kiln_iree_error* kiln_iree_instance_driver_names(kiln_iree_instance* instance,
                                                 char* buffer, size_t capacity,
                                                 size_t* out_length) {
  *out_length = 0;
  iree_allocator_t allocator =
      iree_runtime_instance_host_allocator(instance->instance);
  iree_host_size_t count = 0;
  iree_hal_driver_info_t* infos = NULL;
  iree_status_t status = iree_hal_driver_registry_enumerate(
      iree_runtime_instance_driver_registry(instance->instance), allocator,
      &count, &infos);
  if (!iree_status_is_ok(status)) {
    return kiln_iree_error_from_status(status, "listing the HAL drivers");
  }
  size_t length = 0;
  for (iree_host_size_t i = 0; i < count; ++i) {
    iree_string_view_t name = infos[i].driver_name;
    for (iree_host_size_t j = 0; j <= name.size; ++j) {
      char c = j < name.size ? name.data[j] : '\n';
      if (j == name.size && i + 1 == count) break;  // No trailing separator.
      if (length + 1 < capacity) buffer[length] = c;
      ++length;
    }
  }
  if (capacity > 0) buffer[length < capacity ? length : capacity - 1] = 0;
  *out_length = length;
  iree_allocator_free(allocator, infos);
  return NULL;
}

// IREE's CPU devices allocate each call's transient buffers (several MB a
// batched step) from the heap and free them when the call ends. glibc serves
// blocks that large by mmap, or trims them off the heap's top when freed, so
// every call faulted its transients' pages in afresh: a 32-row batched step
// on the embedded model ran 3.4 ms against 1.1 ms, with 400,000 page faults
// in 230 steps against 9,000, once an eleventh module was loaded and moved
// glibc's sliding mmap threshold (docs/server.md). Fixed thresholds keep
// blocks up to 256 MiB on the heap and the heap's top in place up to 512
// MiB, so the next call reuses the pages. (IREE's caching allocator would
// pool the buffers instead; it is not in the runtime library kiln builds.)
static void keep_transient_pages(const char* uri) {
#ifdef __GLIBC__
  if (strncmp(uri, "local-", 6) == 0) {
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
  }
#else
  (void)uri;
#endif
}

kiln_iree_error* kiln_iree_device_create(kiln_iree_instance* instance,
                                         const char* uri,
                                         kiln_iree_device** out_device) {
  *out_device = NULL;
  keep_transient_pages(uri);
  kiln_iree_device* device = calloc(1, sizeof(*device));
  if (!device) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "creating a device", "out of memory");
  }
  iree_status_t status = iree_hal_create_device(
      iree_runtime_instance_driver_registry(instance->instance),
      iree_make_cstring_view(uri),
      iree_runtime_instance_host_allocator(instance->instance),
      &device->device);
  if (!iree_status_is_ok(status)) {
    free(device);
    return kiln_iree_error_from_status(status, "creating a device");
  }
  *out_device = device;
  return NULL;
}

void kiln_iree_device_release(kiln_iree_device* device) {
  if (!device) return;
  iree_hal_device_release(device->device);
  free(device);
}

// A tensor-parallel world as IREE's devices ask for it: the rank and count
// of the default channel, and the exchange of the root's NCCL id through a
// file (see kiln_iree_device_join_world).
typedef struct kiln_iree_world {
  iree_hal_resource_t resource;
  int32_t rank;
  int32_t count;
  char* rendezvous;  // NULL for a world of one
  uint32_t timeout_ms;
  // Channels made so far: each (one per module that uses collectives) has
  // its own NCCL id, exchanged through its own file, "<rendezvous>.<n>".
  // Every rank loads the same modules in the same order, so the counts
  // agree.
  uint32_t exchanges;
} kiln_iree_world;

static const iree_hal_channel_provider_vtable_t kiln_iree_world_vtable;

static void kiln_iree_world_destroy(iree_hal_channel_provider_t* provider) {
  kiln_iree_world* world = (kiln_iree_world*)provider;
  free(world->rendezvous);
  free(world);
}

static iree_status_t kiln_iree_world_rank_and_count(
    iree_hal_channel_provider_t* provider, int32_t* out_rank,
    int32_t* out_count) {
  kiln_iree_world* world = (kiln_iree_world*)provider;
  *out_rank = world->rank;
  *out_count = world->count;
  return iree_ok_status();
}

static uint64_t kiln_iree_now_ms(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000;
}

// Rank 0: the id into a file of its own beside |path|, renamed onto it once
// whole, so that no rank reads half an id.
static iree_status_t kiln_iree_world_publish(const char* path,
                                             iree_byte_span_t id) {
  size_t length = strlen(path) + 32;
  char* staging = malloc(length);
  if (!staging) {
    return iree_make_status(IREE_STATUS_RESOURCE_EXHAUSTED, "out of memory");
  }
  snprintf(staging, length, "%s.%ld", path, (long)getpid());
  int fd = open(staging, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                0600);
  iree_status_t status = iree_ok_status();
  if (fd < 0) {
    status = iree_make_status(IREE_STATUS_PERMISSION_DENIED,
                              "creating %s: %s", staging, strerror(errno));
  } else {
    ssize_t written = write(fd, id.data, id.data_length);
    int write_errno = errno;
    int closed = close(fd);
    if (written < 0 || closed != 0) {
      status = iree_make_status(IREE_STATUS_DATA_LOSS, "writing %s: %s",
                                staging,
                                strerror(written < 0 ? write_errno : errno));
    } else if (written != (ssize_t)id.data_length) {
      status = iree_make_status(IREE_STATUS_DATA_LOSS,
                                "writing %s: %ld of %zu bytes written",
                                staging, (long)written,
                                (size_t)id.data_length);
    } else if (rename(staging, path) != 0) {
      status = iree_make_status(IREE_STATUS_PERMISSION_DENIED,
                                "renaming %s to %s: %s", staging, path,
                                strerror(errno));
    }
    if (!iree_status_is_ok(status)) unlink(staging);
  }
  free(staging);
  return status;
}

// Every other rank: the root's id, once |path| appears, or an error naming
// the wait when it does not within the timeout.
static iree_status_t kiln_iree_world_receive(const kiln_iree_world* world,
                                             const char* path,
                                             iree_byte_span_t id) {
  uint64_t deadline = kiln_iree_now_ms() + world->timeout_ms;
  for (;;) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
      ssize_t got = read(fd, id.data, id.data_length);
      close(fd);
      if (got != (ssize_t)id.data_length) {
        return iree_make_status(IREE_STATUS_DATA_LOSS,
                                "%s holds %ld bytes, not the %zu of an id",
                                path, (long)got, (size_t)id.data_length);
      }
      return iree_ok_status();
    }
    if (errno != ENOENT) {
      return iree_make_status(IREE_STATUS_PERMISSION_DENIED, "opening %s: %s",
                              path, strerror(errno));
    }
    if (kiln_iree_now_ms() >= deadline) {
      return iree_make_status(
          IREE_STATUS_DEADLINE_EXCEEDED,
          "rank %d waited %u ms for rank 0's id at %s: rank 0 did not start "
          "its collectives",
          world->rank, world->timeout_ms, path);
    }
    struct timespec pause = {0, 5 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
}

static iree_status_t kiln_iree_world_exchange_id(
    iree_hal_channel_provider_t* provider, iree_byte_span_t id) {
  kiln_iree_world* world = (kiln_iree_world*)provider;
  if (world->count == 1) return iree_ok_status();
  size_t length = strlen(world->rendezvous) + 16;
  char* path = malloc(length);
  if (!path) {
    return iree_make_status(IREE_STATUS_RESOURCE_EXHAUSTED, "out of memory");
  }
  snprintf(path, length, "%s.%u", world->rendezvous, world->exchanges++);
  iree_status_t status = world->rank == 0
                             ? kiln_iree_world_publish(path, id)
                             : kiln_iree_world_receive(world, path, id);
  free(path);
  return status;
}

static const iree_hal_channel_provider_vtable_t kiln_iree_world_vtable = {
    .destroy = kiln_iree_world_destroy,
    .query_default_rank_and_count = kiln_iree_world_rank_and_count,
    .exchange_default_id = kiln_iree_world_exchange_id,
};

kiln_iree_error* kiln_iree_device_join_world(kiln_iree_device* device,
                                             int32_t rank, int32_t count,
                                             const char* rendezvous,
                                             uint32_t timeout_ms) {
  if (count < 1 || rank < 0 || rank >= count) {
    return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT, "joining a world",
                               "the rank must be 0 to count - 1");
  }
  if (count > 1 && (!rendezvous || !rendezvous[0])) {
    return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT, "joining a world",
                               "a world of several ranks needs a rendezvous");
  }
  kiln_iree_world* world = calloc(1, sizeof(*world));
  if (!world || (count > 1 && !(world->rendezvous = strdup(rendezvous)))) {
    free(world);
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "joining a world", "out of memory");
  }
  iree_hal_resource_initialize(&kiln_iree_world_vtable, &world->resource);
  world->rank = rank;
  world->count = count;
  world->timeout_ms = timeout_ms;
  iree_hal_channel_provider_t* provider =
      (iree_hal_channel_provider_t*)world;
  iree_hal_device_replace_channel_provider(device->device, provider);
  iree_hal_channel_provider_release(provider);  // the device holds it now
  return NULL;
}

kiln_iree_error* kiln_iree_module_load(kiln_iree_instance* instance,
                                       kiln_iree_device* device,
                                       const uint8_t* data, size_t length,
                                       kiln_iree_module** out_module) {
  *out_module = NULL;
  iree_allocator_t allocator =
      iree_runtime_instance_host_allocator(instance->instance);
  kiln_iree_module* module = calloc(1, sizeof(*module));
  if (!module) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "loading a module", "out of memory");
  }
  iree_runtime_session_options_t options;
  iree_runtime_session_options_initialize(&options);
  iree_status_t status = iree_runtime_session_create_with_device(
      instance->instance, &options, device->device, allocator,
      &module->session);
  // The session takes ownership of this copy and frees it with the libc
  // allocator (free(), which takes aligned_alloc's memory) — also when
  // loading fails — so the caller's bytes need not outlive the call. IREE
  // imports the module's constants in place, and imported heap buffers must
  // be 64-byte aligned (IREE_HAL_HEAP_BUFFER_ALIGNMENT); malloc gives 16.
  enum { kModuleAlignment = 64 };
  void* copy = NULL;
  if (iree_status_is_ok(status)) {
    size_t rounded = (length + kModuleAlignment - 1) / kModuleAlignment *
                     kModuleAlignment;
    if (length == 0 || rounded < length) {
      status = iree_make_status(IREE_STATUS_INVALID_ARGUMENT,
                                "a module of %zu bytes", length);
    } else if (!(copy = aligned_alloc(kModuleAlignment, rounded))) {
      status = iree_make_status(IREE_STATUS_RESOURCE_EXHAUSTED,
                                "no memory for a %zu-byte module", length);
    }
  }
  if (iree_status_is_ok(status)) {
    memcpy(copy, data, length);
    status = iree_runtime_session_append_bytecode_module_from_memory(
        module->session, iree_make_const_byte_span(copy, length),
        iree_allocator_system());
  }
  if (!iree_status_is_ok(status)) {
    iree_runtime_session_release(module->session);
    free(module);
    return kiln_iree_error_from_status(status, "loading a module");
  }
  module->device = device->device;
  module->image = copy;
  iree_hal_device_retain(module->device);
  *out_module = module;
  return NULL;
}

const void* kiln_iree_module_image(const kiln_iree_module* module) {
  return module->image;
}

void kiln_iree_module_release(kiln_iree_module* module) {
  if (!module) return;
  iree_runtime_session_release(module->session);
  iree_hal_device_release(module->device);
  free(module);
}

kiln_iree_error* kiln_iree_call_create(kiln_iree_module* module,
                                       const char* function,
                                       kiln_iree_call** out_call) {
  *out_call = NULL;
  kiln_iree_call* call = calloc(1, sizeof(*call));
  if (!call) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "preparing a call", "out of memory");
  }
  // Bare names refer to the module's own functions; bytecode modules compiled
  // from a plain MLIR file are named "module".
  char qualified[512];
  if (strchr(function, '.') == NULL) {
    snprintf(qualified, sizeof(qualified), "module.%s", function);
  } else {
    snprintf(qualified, sizeof(qualified), "%s", function);
  }
  iree_status_t status = iree_runtime_call_initialize_by_name(
      module->session, iree_make_cstring_view(qualified), &call->call);
  if (!iree_status_is_ok(status)) {
    free(call);
    return kiln_iree_error_from_status(status, "looking up the function");
  }
  call->device = module->device;
  iree_hal_device_retain(call->device);
  *out_call = call;
  return NULL;
}

static iree_hal_element_type_t kiln_iree_to_hal_type(kiln_iree_element_type t) {
  switch (t) {
    case KILN_IREE_F32: return IREE_HAL_ELEMENT_TYPE_FLOAT_32;
    case KILN_IREE_F16: return IREE_HAL_ELEMENT_TYPE_FLOAT_16;
    case KILN_IREE_BF16: return IREE_HAL_ELEMENT_TYPE_BFLOAT_16;
    // MLIR's i32 is signless; so is the element type the module asserts.
    case KILN_IREE_I32: return IREE_HAL_ELEMENT_TYPE_INT_32;
    case KILN_IREE_I4: return IREE_HAL_ELEMENT_TYPE_INT_4;
    case KILN_IREE_I8: return IREE_HAL_ELEMENT_TYPE_INT_8;
  }
  return IREE_HAL_ELEMENT_TYPE_NONE;
}

kiln_iree_error* kiln_iree_call_push_tensor(kiln_iree_call* call,
                                            kiln_iree_tensor* tensor) {
  return kiln_iree_error_from_status(
      iree_runtime_call_inputs_push_back_buffer_view(&call->call, tensor->view),
      "passing an input tensor");
}

// Elements of a tensor of |rank| |dims|.
static iree_device_size_t kiln_iree_element_count(iree_host_size_t rank,
                                                  const iree_hal_dim_t* dims) {
  iree_device_size_t count = 1;
  for (iree_host_size_t i = 0; i < rank; ++i) count *= dims[i];
  return count;
}

// Bytes of a dense tensor of |rank| |dims| and |type|, sub-byte types packed
// (IREE's own size helper refuses them: it sizes views it may index).
static iree_device_size_t kiln_iree_dense_length(iree_hal_element_type_t type,
                                                 iree_host_size_t rank,
                                                 const iree_hal_dim_t* dims) {
  iree_device_size_t bits =
      kiln_iree_element_count(rank, dims) * iree_hal_element_bit_count(type);
  return (bits + 7) / 8;
}

// A device tensor of |type| holding |data|, which must be exactly its dense
// length. IREE's iree_hal_buffer_view_allocate_buffer_copy makes the same
// calls, but sizes the buffer with a helper that refuses sub-byte types and
// copies min(length, size) bytes, where a wrong length should be an error.
static iree_status_t kiln_iree_upload_dense(
    iree_hal_device_t* device, iree_host_size_t rank,
    const iree_hal_dim_t* dims, iree_hal_element_type_t type,
    iree_hal_buffer_params_t params, iree_const_byte_span_t data,
    iree_hal_buffer_view_t** out_view) {
  iree_device_size_t length = kiln_iree_dense_length(type, rank, dims);
  if (data.data_length != length) {
    return iree_make_status(IREE_STATUS_INVALID_ARGUMENT,
                            "data of %" PRIhsz
                            " bytes for a tensor of %" PRIdsz " bytes",
                            data.data_length, length);
  }
  iree_hal_buffer_params_canonicalize(&params);
  iree_hal_buffer_t* buffer = NULL;
  iree_status_t status = iree_hal_allocator_allocate_buffer(
      iree_hal_device_allocator(device), params, length, &buffer);
  if (iree_status_is_ok(status) && length > 0) {
    status = iree_hal_device_transfer_h2d(
        device, data.data, buffer, 0, length,
        IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT, iree_infinite_timeout());
  }
  if (iree_status_is_ok(status)) {
    status = iree_hal_buffer_view_create(
        buffer, rank, dims, type, IREE_HAL_ENCODING_TYPE_DENSE_ROW_MAJOR,
        iree_hal_device_host_allocator(device), out_view);
  }
  iree_hal_buffer_release(buffer);
  return status;
}

kiln_iree_error* kiln_iree_tensor_upload(kiln_iree_device* device,
                                         kiln_iree_element_type type,
                                         const int64_t* shape, size_t rank,
                                         const void* data, size_t length,
                                         kiln_iree_tensor** out_tensor) {
  *out_tensor = NULL;
  enum { kMaxRank = 16 };
  if (rank > kMaxRank) {
    return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT, "a tensor",
                               "rank above 16");
  }
  iree_hal_dim_t dims[kMaxRank];
  for (size_t i = 0; i < rank; ++i) {
    if (shape[i] < 0) {
      return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT, "a tensor",
                                 "negative dimension");
    }
    dims[i] = (iree_hal_dim_t)shape[i];
  }
  kiln_iree_tensor* tensor = calloc(1, sizeof(*tensor));
  if (!tensor) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "uploading a tensor", "out of memory");
  }
  iree_hal_buffer_params_t params = {
      .type = IREE_HAL_MEMORY_TYPE_DEVICE_LOCAL,
      .usage = IREE_HAL_BUFFER_USAGE_DEFAULT,
  };
  iree_status_t status = kiln_iree_upload_dense(
      device->device, rank, dims, kiln_iree_to_hal_type(type), params,
      iree_make_const_byte_span(data, length), &tensor->view);
  if (!iree_status_is_ok(status)) {
    free(tensor);
    return kiln_iree_error_from_status(status, "uploading a tensor");
  }
  tensor->device = device->device;
  iree_hal_device_retain(tensor->device);
  *out_tensor = tensor;
  return NULL;
}

kiln_iree_error* kiln_iree_call_invoke(kiln_iree_call* call) {
  return kiln_iree_error_from_status(
      iree_runtime_call_invoke(&call->call, /*flags=*/0), "invoking");
}

// Appends |fence| (NULL: a null reference, which async functions read as
// "nothing to wait for") to the call's inputs.
static iree_status_t kiln_iree_call_push_fence(kiln_iree_call* call,
                                               kiln_iree_fence* fence) {
  iree_vm_ref_t ref = iree_vm_ref_null();
  if (fence) ref = iree_hal_fence_retain_ref(fence->fence);
  return iree_vm_list_push_ref_move(iree_runtime_call_inputs(&call->call),
                                    &ref);
}

kiln_iree_error* kiln_iree_call_invoke_async(kiln_iree_call* call,
                                             kiln_iree_fence* wait,
                                             kiln_iree_fence* signal) {
  if (!signal) {
    return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT, "invoking",
                               "an asynchronous call needs a signal fence");
  }
  iree_status_t status = kiln_iree_call_push_fence(call, wait);
  if (iree_status_is_ok(status)) {
    status = kiln_iree_call_push_fence(call, signal);
  }
  if (iree_status_is_ok(status)) {
    status = iree_runtime_call_invoke(&call->call, /*flags=*/0);
  }
  return kiln_iree_error_from_status(status, "invoking");
}

size_t kiln_iree_call_output_count(kiln_iree_call* call) {
  return iree_vm_list_size(iree_runtime_call_outputs(&call->call));
}

kiln_iree_error* kiln_iree_call_pop_output(kiln_iree_call* call,
                                           kiln_iree_tensor** out_tensor) {
  *out_tensor = NULL;
  kiln_iree_tensor* tensor = calloc(1, sizeof(*tensor));
  if (!tensor) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "reading an output", "out of memory");
  }
  iree_status_t status =
      iree_runtime_call_outputs_pop_front_buffer_view(&call->call, &tensor->view);
  if (!iree_status_is_ok(status)) {
    free(tensor);
    return kiln_iree_error_from_status(status, "reading an output");
  }
  tensor->device = call->device;
  iree_hal_device_retain(tensor->device);
  *out_tensor = tensor;
  return NULL;
}

void kiln_iree_call_release(kiln_iree_call* call) {
  if (!call) return;
  iree_runtime_call_deinitialize(&call->call);
  iree_hal_device_release(call->device);
  free(call);
}

size_t kiln_iree_tensor_rank(const kiln_iree_tensor* tensor) {
  return iree_hal_buffer_view_shape_rank(tensor->view);
}

int64_t kiln_iree_tensor_dim(const kiln_iree_tensor* tensor, size_t index) {
  return (int64_t)iree_hal_buffer_view_shape_dim(tensor->view, index);
}

kiln_iree_error* kiln_iree_tensor_element_type(const kiln_iree_tensor* tensor,
                                               kiln_iree_element_type* out_type) {
  switch (iree_hal_buffer_view_element_type(tensor->view)) {
    case IREE_HAL_ELEMENT_TYPE_FLOAT_32: *out_type = KILN_IREE_F32; return NULL;
    case IREE_HAL_ELEMENT_TYPE_FLOAT_16: *out_type = KILN_IREE_F16; return NULL;
    case IREE_HAL_ELEMENT_TYPE_BFLOAT_16: *out_type = KILN_IREE_BF16; return NULL;
    case IREE_HAL_ELEMENT_TYPE_INT_32:
    case IREE_HAL_ELEMENT_TYPE_SINT_32:
    case IREE_HAL_ELEMENT_TYPE_UINT_32: *out_type = KILN_IREE_I32; return NULL;
    case IREE_HAL_ELEMENT_TYPE_INT_4:
    case IREE_HAL_ELEMENT_TYPE_SINT_4: *out_type = KILN_IREE_I4; return NULL;
    case IREE_HAL_ELEMENT_TYPE_INT_8:
    case IREE_HAL_ELEMENT_TYPE_SINT_8: *out_type = KILN_IREE_I8; return NULL;
    default: {
      char detail[64];
      snprintf(detail, sizeof(detail), "unsupported element type 0x%08x",
               (unsigned)iree_hal_buffer_view_element_type(tensor->view));
      return kiln_iree_error_new(IREE_STATUS_UNIMPLEMENTED, "an output tensor",
                                 detail);
    }
  }
}

size_t kiln_iree_tensor_byte_length(const kiln_iree_tensor* tensor) {
  iree_hal_buffer_view_t* view = tensor->view;
  // A view's own byte length rounds each sub-byte element up to a byte.
  return (size_t)kiln_iree_dense_length(
      iree_hal_buffer_view_element_type(view),
      iree_hal_buffer_view_shape_rank(view),
      iree_hal_buffer_view_shape_dims(view));
}

// An error unless |length| is |tensor|'s byte length.
static kiln_iree_error* kiln_iree_check_read_length(
    const kiln_iree_tensor* tensor, size_t length) {
  if (length == kiln_iree_tensor_byte_length(tensor)) return NULL;
  return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT,
                             "reading an output tensor",
                             "target length differs from the tensor's");
}

kiln_iree_error* kiln_iree_tensor_read(kiln_iree_tensor* tensor, void* target,
                                       size_t length) {
  kiln_iree_error* error = kiln_iree_check_read_length(tensor, length);
  if (error) return error;
  return kiln_iree_error_from_status(
      iree_hal_device_transfer_d2h(
          tensor->device, iree_hal_buffer_view_buffer(tensor->view), 0, target,
          length, IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT, iree_infinite_timeout()),
      "reading an output tensor");
}

void kiln_iree_tensor_release(kiln_iree_tensor* tensor) {
  if (!tensor) return;
  iree_hal_buffer_view_release(tensor->view);
  iree_hal_device_release(tensor->device);
  free(tensor);
}

kiln_iree_error* kiln_iree_reader_create(kiln_iree_device* device,
                                         kiln_iree_reader** out_reader) {
  *out_reader = NULL;
  kiln_iree_reader* reader = calloc(1, sizeof(*reader));
  if (!reader) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "creating a reader", "out of memory");
  }
  reader->device = device->device;
  iree_hal_device_retain(reader->device);
  *out_reader = reader;
  return NULL;
}

// Makes the staging buffer hold at least |length| bytes.
static iree_status_t kiln_iree_reader_reserve(kiln_iree_reader* reader,
                                              iree_device_size_t length) {
  if (reader->staging && reader->capacity >= length) return iree_ok_status();
  iree_hal_buffer_release(reader->staging);
  reader->staging = NULL;
  reader->capacity = 0;
  iree_hal_buffer_params_t params = {
      .type = IREE_HAL_MEMORY_TYPE_HOST_LOCAL |
              IREE_HAL_MEMORY_TYPE_DEVICE_VISIBLE,
      .usage = IREE_HAL_BUFFER_USAGE_TRANSFER | IREE_HAL_BUFFER_USAGE_MAPPING,
  };
  IREE_RETURN_IF_ERROR(iree_hal_allocator_allocate_buffer(
      iree_hal_device_allocator(reader->device), params, length,
      &reader->staging));
  reader->capacity = length;
  return iree_ok_status();
}

// Whether |reader| can read |tensor| now: the same device, no read in flight.
static kiln_iree_error* kiln_iree_reader_check(kiln_iree_reader* reader,
                                               kiln_iree_tensor* tensor) {
  if (tensor->device != reader->device) {
    return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT,
                               "reading an output tensor",
                               "the tensor lives on another device");
  }
  if (reader->in_flight) {
    return kiln_iree_error_new(IREE_STATUS_FAILED_PRECONDITION,
                               "reading an output tensor",
                               "the reader has a read in flight");
  }
  return NULL;
}

kiln_iree_error* kiln_iree_reader_read(kiln_iree_reader* reader,
                                       kiln_iree_tensor* tensor, void* target,
                                       size_t length) {
  kiln_iree_error* error = kiln_iree_check_read_length(tensor, length);
  if (error) return error;
  error = kiln_iree_reader_check(reader, tensor);
  if (error) return error;
  if (length == 0) return NULL;
  iree_status_t status = kiln_iree_reader_reserve(reader, length);
  if (iree_status_is_ok(status)) {
    status = iree_hal_device_transfer_range(
        reader->device,
        iree_hal_make_device_transfer_buffer(
            iree_hal_buffer_view_buffer(tensor->view)),
        0, iree_hal_make_device_transfer_buffer(reader->staging), 0, length,
        IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT, iree_infinite_timeout());
  }
  if (iree_status_is_ok(status)) {
    status = iree_hal_buffer_map_read(reader->staging, 0, target, length);
  }
  return kiln_iree_error_from_status(status, "reading an output tensor");
}

kiln_iree_error* kiln_iree_reader_start(kiln_iree_reader* reader,
                                        kiln_iree_tensor* tensor,
                                        kiln_iree_fence* after,
                                        kiln_iree_fence* done) {
  kiln_iree_error* error = kiln_iree_reader_check(reader, tensor);
  if (error) return error;
  iree_device_size_t length =
      kiln_iree_tensor_byte_length(tensor);
  if (length == 0) {
    return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT,
                               "reading an output tensor",
                               "the tensor is empty");
  }
  iree_status_t status = kiln_iree_reader_reserve(reader, length);
  if (iree_status_is_ok(status)) {
    iree_hal_semaphore_list_t wait =
        after ? iree_hal_fence_semaphore_list(after->fence)
              : iree_hal_semaphore_list_empty();
    status = iree_hal_device_queue_copy(
        reader->device, IREE_HAL_QUEUE_AFFINITY_ANY, wait,
        iree_hal_fence_semaphore_list(done->fence),
        iree_hal_buffer_view_buffer(tensor->view), 0, reader->staging, 0,
        length, IREE_HAL_COPY_FLAG_NONE);
  }
  if (iree_status_is_ok(status)) reader->in_flight = length;
  return kiln_iree_error_from_status(status, "reading an output tensor");
}

kiln_iree_error* kiln_iree_reader_finish(kiln_iree_reader* reader,
                                         kiln_iree_fence* done, void* target,
                                         size_t length) {
  if (!reader->in_flight) {
    return kiln_iree_error_new(IREE_STATUS_FAILED_PRECONDITION,
                               "reading an output tensor",
                               "no read is in flight");
  }
  if (length != reader->in_flight) {
    return kiln_iree_error_new(IREE_STATUS_INVALID_ARGUMENT,
                               "reading an output tensor",
                               "the target's length is not the tensor's");
  }
  iree_status_t status = iree_hal_fence_wait(
      done->fence, iree_infinite_timeout(), IREE_HAL_WAIT_FLAG_DEFAULT);
  // Failed or not, the staging buffer is free for the next read.
  reader->in_flight = 0;
  if (iree_status_is_ok(status)) {
    status = iree_hal_buffer_map_read(reader->staging, 0, target, length);
  }
  return kiln_iree_error_from_status(status, "reading an output tensor");
}

kiln_iree_error* kiln_iree_fence_create(kiln_iree_device* device,
                                        kiln_iree_fence** out_fence) {
  *out_fence = NULL;
  kiln_iree_fence* fence = calloc(1, sizeof(*fence));
  if (!fence) {
    return kiln_iree_error_new(IREE_STATUS_RESOURCE_EXHAUSTED,
                               "creating a fence", "out of memory");
  }
  iree_hal_semaphore_t* semaphore = NULL;
  iree_status_t status = iree_hal_semaphore_create(
      device->device, IREE_HAL_QUEUE_AFFINITY_ANY, 0,
      IREE_HAL_SEMAPHORE_FLAG_DEFAULT, &semaphore);
  if (iree_status_is_ok(status)) {
    status = iree_hal_fence_create_at(
        semaphore, 1, iree_hal_device_host_allocator(device->device),
        &fence->fence);
  }
  iree_hal_semaphore_release(semaphore);
  if (!iree_status_is_ok(status)) {
    free(fence);
    return kiln_iree_error_from_status(status, "creating a fence");
  }
  *out_fence = fence;
  return NULL;
}

kiln_iree_error* kiln_iree_fence_wait(kiln_iree_fence* fence) {
  return kiln_iree_error_from_status(
      iree_hal_fence_wait(fence->fence, iree_infinite_timeout(),
                          IREE_HAL_WAIT_FLAG_DEFAULT),
      "waiting for queued work");
}

void kiln_iree_fence_release(kiln_iree_fence* fence) {
  if (!fence) return;
  iree_hal_fence_release(fence->fence);
  free(fence);
}

void kiln_iree_reader_release(kiln_iree_reader* reader) {
  if (!reader) return;
  iree_hal_buffer_release(reader->staging);
  iree_hal_device_release(reader->device);
  free(reader);
}
