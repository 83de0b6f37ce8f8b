//! Build script of kiln-iree: compiles the C shim, binds its header, and turns
//! the IREE prefix's link description into rustc link directives. It is the
//! one place in kiln where the IREE link recipe is read; no archive name is
//! written here, only the pkg-config package name of the prefix.
//!
//! # Environment
//!
//! - `KILN_IREE_PREFIX` (required): an IREE runtime prefix, as built by
//!   `cargo xtask iree [--cuda]` or the flake's `iree-runtime[-cuda]` package:
//!   `include/`, `lib/*.a` and `lib/pkgconfig/iree-runtime.pc`. Unset, the
//!   build stops with the commands that make one (`cargo xtask iree --cuda`
//!   with `eval "$(cargo xtask env)"`, or `nix develop`).
//! - `CARGO_FEATURE_CUDA`: with the `cuda` feature the prefix must list `cuda`
//!   in its `hal_drivers` variable.
//! - `PKG_CONFIG`: the pkg-config program to run (default `pkg-config`).
//! - `LIBCLANG_PATH`: where bindgen finds libclang, if not in the usual places.
//!
//! # Outputs
//!
//! - the static library `kiln_iree_shim` (the shim), then every library of the
//!   prefix's `Libs:` line in order: archives found in the prefix's `lib/` as
//!   static libraries, the rest (`m`, `dl`, …) as system libraries;
//! - `$OUT_DIR/bindings.rs`, the bindings of `csrc/kiln_iree.h` only;
//! - `KILN_IREE_RUNTIME_REVISION`, `KILN_IREE_HAL_DRIVERS` and
//!   `KILN_IREE_PREFIX_TARGET` (the Rust target triple the prefix was built
//!   for, which must be this build's `TARGET`) for the crate.

use std::path::PathBuf;

/// The package the prefix's pkg-config file describes.
const PKG_CONFIG_NAME: &str = "iree-runtime";

fn main() {
    if let Err(lines) = build() {
        for line in lines {
            println!("cargo::error={line}");
        }
    }
}

fn build() -> Result<(), Vec<String>> {
    println!("cargo::rerun-if-env-changed=KILN_IREE_PREFIX");
    println!("cargo::rerun-if-env-changed=PKG_CONFIG");
    println!("cargo::rerun-if-env-changed=LIBCLANG_PATH");
    println!("cargo::rerun-if-changed=csrc/kiln_iree.h");
    println!("cargo::rerun-if-changed=csrc/kiln_iree.c");

    let prefix = iree_prefix()?;
    let pc_file = prefix
        .join("lib/pkgconfig")
        .join(format!("{PKG_CONFIG_NAME}.pc"));
    if !pc_file.is_file() {
        return Err(vec![
            format!(
                "KILN_IREE_PREFIX={} has no lib/pkgconfig/{PKG_CONFIG_NAME}.pc, so it is not an IREE prefix built for kiln.",
                prefix.display()
            ),
            "Build one with `cargo xtask iree --cuda` and `eval \"$(cargo xtask env)\"`, or use `nix develop`.".into(),
        ]);
    }
    println!("cargo::rerun-if-changed={}", pc_file.display());

    // pkg-config accepts the path of a .pc file in place of a package name, so
    // the prefix is used as given, with no search path to set up.
    let pc_arg = pc_file.to_str().ok_or_else(|| {
        vec![format!(
            "the prefix path {} is not valid UTF-8",
            prefix.display()
        )]
    })?;
    let prefix_target = pkg_config::get_variable(pc_arg, "target").map_err(|e| {
        pkg_config_missing(&e).unwrap_or_else(|| {
            vec![
                format!(
                    "{} names no `target` (the triple its archives were built for): {e}",
                    pc_file.display()
                ),
                "It predates kiln's cross builds; rebuild it with `cargo xtask iree --cuda`."
                    .into(),
            ]
        })
    })?;
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    if prefix_target != target {
        return Err(vec![
            format!(
                "KILN_IREE_PREFIX={} was built for {prefix_target}, but this build is for {target}.",
                prefix.display()
            ),
            format!(
                "Build a prefix for {target} with `cargo xtask iree --cuda --target {target}` and point KILN_IREE_PREFIX at it (`eval \"$(cargo xtask env --target {target})\"`)."
            ),
        ]);
    }
    if !target_is_host(&target) {
        // pkg-config refuses cross builds unless told otherwise, for fear of
        // the host's packages; this one reads a prefix given by path, and its
        // target was just checked.
        // SAFETY: a build script is single-threaded.
        unsafe { std::env::set_var("PKG_CONFIG_ALLOW_CROSS", "1") };
    }
    let library = pkg_config::Config::new()
        .statik(true)
        .cargo_metadata(false)
        .env_metadata(false)
        .probe(pc_arg)
        .map_err(|e| {
            pkg_config_missing(&e).unwrap_or_else(|| {
                vec![format!(
                    "pkg-config could not read {}: {e}",
                    pc_file.display()
                )]
            })
        })?;
    let variable = |name: &str| {
        pkg_config::get_variable(pc_arg, name).map_err(|e| {
            pkg_config_missing(&e).unwrap_or_else(|| {
                vec![format!(
                    "{} has no `{name}` variable: {e}",
                    pc_file.display()
                )]
            })
        })
    };
    let drivers = variable("hal_drivers")?;
    let revision = variable("iree_revision")?;
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some()
        && !drivers.split_whitespace().any(|d| d == "cuda")
    {
        return Err(vec![
            format!(
                "the `cuda` feature needs an IREE prefix with the CUDA HAL driver, but {} has only: {drivers}.",
                prefix.display()
            ),
            "Build one with `cargo xtask iree --cuda` and point KILN_IREE_PREFIX at it (`eval \"$(cargo xtask env)\"`), or use `nix develop`.".into(),
        ]);
    }
    println!("cargo::rustc-env=KILN_IREE_RUNTIME_REVISION={revision}");
    println!("cargo::rustc-env=KILN_IREE_HAL_DRIVERS={drivers}");
    println!("cargo::rustc-env=KILN_IREE_PREFIX_TARGET={prefix_target}");

    compile_shim(&library.include_paths, &target)?;
    generate_bindings()?;
    emit_link_directives(&library);
    Ok(())
}

fn iree_prefix() -> Result<PathBuf, Vec<String>> {
    match std::env::var_os("KILN_IREE_PREFIX") {
        Some(dir) if !dir.is_empty() => Ok(PathBuf::from(dir)),
        _ => Err(vec![
            "kiln-iree links the IREE runtime from a prefix, and KILN_IREE_PREFIX is unset.".into(),
            "Without Nix: `cargo xtask iree --cuda && eval \"$(cargo xtask env)\"` builds one from the pinned source and sets it.".into(),
            "With Nix: `nix develop` sets it.".into(),
        ]),
    }
}

// What installs a missing program: `cargo xtask setup`, whose table
// (crates/xtask/src/setup.rs) has every package named here; a test of xtask
// holds this file to it.
const NEEDS_PKG_CONFIG: &str = "pkg-config is needed (or set PKG_CONFIG to one): \
    `cargo xtask setup` installs it (Debian/Ubuntu package pkg-config: \
    apt-get install -y pkg-config)";
const NEEDS_CC: &str = "a C compiler is needed: `cargo xtask setup` installs it \
    (Debian/Ubuntu package build-essential: apt-get install -y build-essential)";
const NEEDS_CROSS_CC: &str = "the aarch64 cross C compiler is needed: `cargo xtask setup` \
    installs it (Debian/Ubuntu package gcc-aarch64-linux-gnu: \
    apt-get install -y gcc-aarch64-linux-gnu)";

/// The error lines for a pkg-config that could not be run at all, rather
/// than pkg-config's verdict on the prefix's file.
fn pkg_config_missing(e: &pkg_config::Error) -> Option<Vec<String>> {
    match e {
        pkg_config::Error::Command { command, cause }
            if cause.kind() == std::io::ErrorKind::NotFound =>
        {
            Some(vec![
                format!(
                    "kiln-iree's build script reads the IREE prefix's link recipe with pkg-config, and `{command}` could not start: {cause}."
                ),
                NEEDS_PKG_CONFIG.into(),
            ])
        }
        _ => None,
    }
}

/// The shim is the only C that includes IREE headers. cc emits its link
/// directive first, so the shim precedes the IREE archives on the link line.
fn compile_shim(include_paths: &[PathBuf], target: &str) -> Result<(), Vec<String>> {
    let mut build = cc::Build::new();
    for dir in include_paths {
        // IREE's headers as system headers: their warnings are not ours.
        build.flag("-isystem").flag(dir);
    }
    build
        .file("csrc/kiln_iree.c")
        .std("c11")
        // Needed by IREE's headers under -std=c11 (POSIX declarations).
        .define("_GNU_SOURCE", None)
        // Every unit including iree/runtime/api.h must pick the system
        // allocator implementation, else `iree_allocator_system` is undefined
        // at link time.
        .define("IREE_ALLOCATOR_SYSTEM_CTL", "iree_allocator_libc_ctl")
        .warnings(true);
    // `compile` panics when no C compiler is found: this says which package
    // has one (a compiler that runs and fails has said why itself).
    build.try_compile("kiln_iree_shim").map_err(|e| {
        let mut lines = vec![format!(
            "cannot compile the C shim csrc/kiln_iree.c for {target}: {e}"
        )];
        let runs = build.try_get_compiler().is_ok_and(|compiler| {
            std::process::Command::new(compiler.path())
                .arg("--version")
                .output()
                .is_ok()
        });
        if !runs {
            let cross = target.starts_with("aarch64-") && !target_is_host(target);
            lines.push(if cross { NEEDS_CROSS_CC } else { NEEDS_CC }.into());
        }
        lines
    })
}

fn target_is_host(target: &str) -> bool {
    std::env::var("HOST").ok().as_deref() == Some(target)
}

/// What to do when bindgen cannot run: it needs libclang.
const NEEDS_LIBCLANG: &str = "bindgen needs libclang: `cargo xtask setup` installs it \
    (Debian/Ubuntu package libclang-dev: apt-get install -y libclang-dev), or set LIBCLANG_PATH \
    to the folder that holds it";

fn generate_bindings() -> Result<(), Vec<String>> {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let builder = bindgen::Builder::default()
        .header("csrc/kiln_iree.h")
        .allowlist_function("kiln_iree_.*")
        .allowlist_type("kiln_iree_.*")
        .default_enum_style(bindgen::EnumVariation::ModuleConsts);
    // Without libclang, bindgen panics ("Unable to find libclang") instead
    // of returning an error: its panic becomes this script's named error.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    // The builder is dropped with the panic: nothing of it is seen again.
    let generated =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate()));
    std::panic::set_hook(default_hook);
    let bindings = match generated {
        Err(_) => return Err(vec![format!("libclang was not found; {NEEDS_LIBCLANG}")]),
        Ok(Err(e)) => {
            return Err(vec![format!(
                "bindgen failed on csrc/kiln_iree.h: {e} ({NEEDS_LIBCLANG})"
            )]);
        }
        Ok(Ok(bindings)) => bindings,
    };
    bindings
        .write_to_file(out.join("bindings.rs"))
        .map_err(|e| vec![format!("cannot write bindings.rs: {e}")])
}

/// Every `-l` of the `Libs:` line, in order. An archive that the prefix holds
/// is linked statically and *not bundled* into kiln-iree's rlib: it stays a
/// separate input of the final link, in the prefix's order, so the final link
/// sees the same recipe the prefix was verified with.
fn emit_link_directives(library: &pkg_config::Library) {
    for dir in &library.link_paths {
        println!("cargo::rustc-link-search=native={}", dir.display());
    }
    for name in &library.libs {
        let archive = format!("lib{name}.a");
        let in_prefix = library
            .link_paths
            .iter()
            .map(|d| d.join(&archive))
            .find(|p| p.is_file());
        match in_prefix {
            Some(path) => {
                println!("cargo::rerun-if-changed={}", path.display());
                println!("cargo::rustc-link-lib=static:-bundle={name}");
            }
            None => println!("cargo::rustc-link-lib=dylib={name}"),
        }
    }
    // Flags that are not libraries (e.g. -pthread) can only be passed to the
    // linker driver as they are.
    for args in &library.ld_args {
        println!("cargo::rustc-link-arg=-Wl,{}", args.join(","));
    }
}
