// Link probe for the IREE prefix: touches the runtime entry points an embedder
// uses (instance, driver registry, device creation, sessions, calls), so that
// the link fails here, at prefix-build time, if the archive set is incomplete.
#include <stdio.h>

#include "iree/runtime/api.h"

int main(int argc, char** argv) {
  const char* uri = argc > 1 ? argv[1] : "local-sync";
  iree_runtime_instance_options_t options;
  iree_runtime_instance_options_initialize(&options);
  iree_runtime_instance_options_use_all_available_drivers(&options);
  iree_runtime_instance_t* instance = NULL;
  iree_status_t status = iree_runtime_instance_create(
      &options, iree_allocator_system(), &instance);
  iree_hal_device_t* device = NULL;
  if (iree_status_is_ok(status)) {
    status = iree_hal_create_device(
        iree_runtime_instance_driver_registry(instance),
        iree_make_cstring_view(uri),
        iree_runtime_instance_host_allocator(instance), &device);
  }
  iree_runtime_session_t* session = NULL;
  if (iree_status_is_ok(status)) {
    iree_runtime_session_options_t session_options;
    iree_runtime_session_options_initialize(&session_options);
    status = iree_runtime_session_create_with_device(
        instance, &session_options, device,
        iree_runtime_instance_host_allocator(instance), &session);
  }
  int exit_code = 0;
  if (!iree_status_is_ok(status)) {
    iree_status_fprint(stderr, status);
    iree_status_free(status);
    exit_code = 1;
  } else {
    printf("kiln_iree_link_probe: created a session on %s\n", uri);
  }
  iree_runtime_session_release(session);
  iree_hal_device_release(device);
  iree_runtime_instance_release(instance);
  return exit_code;
}
