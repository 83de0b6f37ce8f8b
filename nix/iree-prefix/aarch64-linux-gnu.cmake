# Cross-compiling the IREE runtime for aarch64 Linux (the GB10) with Debian's
# cross toolchain (gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu,
# libc6-dev-arm64-cross): `cargo xtask iree --target aarch64-unknown-linux-gnu`.
# IREE's code generators come from a host prefix (IREE_HOST_BIN_DIR), and the
# probe runs under qemu-aarch64 (qemu-user).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
