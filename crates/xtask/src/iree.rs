//! `cargo xtask iree [--cuda]`: the IREE runtime built from the pinned source
//! into a prefix in the cache, keyed by everything that went into it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Pins, for_system, repo_root};
use crate::prefix::{self, Identity};
use crate::target::Target;
use crate::tools::pinned_tool;
use build_support::digest::content_key;
use build_support::unpack;

/// Which runtime to build: CPU drivers only, or with the CUDA HAL driver.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    Cpu,
    Cuda,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Cpu => "cpu",
            Variant::Cuda => "cuda",
        }
    }
}

/// The CMake project that links the probe (shared with the Nix derivation).
fn cmake_project() -> PathBuf {
    repo_root().join("nix").join("iree-prefix")
}

/// The CMake toolchain file of a cross build (in nix/iree-prefix).
fn cross_toolchain_file(target: &Target) -> String {
    format!("{}.cmake", target.gnu())
}

/// The prefix's folder for the current pins, and the inputs its name hashes.
pub fn prefix_location(
    cache: &Cache,
    pins: &Pins,
    variant: Variant,
    target: &Target,
) -> Result<(PathBuf, serde_json::Value)> {
    let system = target.system;
    let mut project = vec!["CMakeLists.txt".to_string(), "link_probe.c".to_string()];
    if target.cross {
        project.push(cross_toolchain_file(target));
    }
    let project_files: Vec<(String, String)> = project
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(cmake_project().join(name))
                .with_context(|| format!("cannot read nix/iree-prefix/{name}"))?;
            Ok((name.to_string(), text))
        })
        .collect::<Result<_>>()?;
    let cuda_wheels = match variant {
        Variant::Cpu => json!(null),
        Variant::Cuda => json!(pins.cuda.wheels),
    };
    let inputs = json!({
        "variant": variant.name(),
        "system": system,
        "target": target.triple,
        "iree": { "version": pins.iree.version, "revision": pins.iree.revision, "source": pins.iree.source },
        "cmake_options": pins.cmake_options(variant == Variant::Cuda),
        "cuda_wheels": cuda_wheels,
        "tools": { "cmake": pins.tools.cmake, "ninja": pins.tools.ninja },
        "cmake_project": project_files,
        "patches": crate::iree_patches::list()?,
        // The installer decides the layout; a change to it is a new prefix.
        "installer": include_str!("prefix.rs"),
        "c_toolchain": target.c_toolchain()?,
    });
    let key = content_key(&inputs);
    let dir = cache.path("iree-runtime").join(format!(
        "{}{}-{}",
        target.cache_tag(),
        variant.name(),
        &key[..16]
    ));
    Ok((dir, inputs))
}

/// Builds (or finds) the prefix; returns its path.
pub fn build(cache: &Cache, pins: &Pins, variant: Variant, target: &Target) -> Result<PathBuf> {
    let (dest, inputs) = prefix_location(cache, pins, variant, target)?;
    let what = format!("{}{}", target.cache_tag(), variant.name());
    if cache.reusable(&dest)? {
        eprintln!("IREE prefix ({what}) is up to date: {}", dest.display());
        return Ok(dest);
    }
    // A cross build runs IREE's code generators (iree-flatcc-cli,
    // iree-c-embed-data) from the host's CPU prefix, which installs them.
    let host_tools = if target.cross {
        let host = build(cache, pins, Variant::Cpu, &Target::host()?)?;
        Some(host.join(prefix::HOST_TOOLS_DIR))
    } else {
        None
    };
    let started = Instant::now();
    // The build tools run here; the CUDA headers are the target's.
    let system = Target::host()?.system;
    let source = crate::iree_patches::patched_source(cache, pins)?;
    let cmake = pinned_tool(cache, &pins.tools.cmake, "cmake", system)?;
    let ninja = pinned_tool(cache, &pins.tools.ninja, "ninja", system)?;
    let cuda_deps = match variant {
        Variant::Cpu => None,
        Variant::Cuda => Some(cuda_deps_dir(cache, pins, target.system)?),
    };

    let build_dir = cache
        .path("build")
        .join(dest.file_name().expect("prefix folder has a name"));
    if build_dir.exists() {
        // A build dir left by an interrupted run may hold a stale configuration.
        std::fs::remove_dir_all(&build_dir)?;
    }
    // Ask CMake's file API for the code model: the installer reads the
    // probe's link line from it (see nix/iree-prefix/CMakeLists.txt).
    let query = build_dir.join(".cmake/api/v1/query");
    std::fs::create_dir_all(&query)?;
    std::fs::write(query.join("codemodel-v2"), "")?;

    let mut configure = Command::new(&cmake);
    configure
        .arg("-G")
        .arg("Ninja")
        .arg("-S")
        .arg(cmake_project())
        .arg("-B")
        .arg(&build_dir)
        .arg(format!("-DCMAKE_MAKE_PROGRAM={}", ninja.display()))
        .arg(format!("-DKILN_IREE_SOURCE_DIR={}", source.display()));
    for (name, value) in pins.cmake_options(variant == Variant::Cuda) {
        configure.arg(format!("-D{name}={value}"));
    }
    if let Some(tools) = &host_tools {
        configure
            .arg(format!(
                "-DCMAKE_TOOLCHAIN_FILE={}",
                cmake_project().join(cross_toolchain_file(target)).display()
            ))
            .arg(format!("-DIREE_HOST_BIN_DIR={}", tools.display()));
    }
    if let Some(deps) = &cuda_deps {
        configure.env("IREE_CUDA_DEPS_DIR", deps);
    }
    crate::process::logged(
        configure,
        &build_dir.join("kiln-configure.log"),
        "configuring IREE",
        None,
    )?;

    let mut ninja_cmd = Command::new(&ninja);
    ninja_cmd
        .arg("-C")
        .arg(&build_dir)
        .arg("kiln_iree_link_probe")
        .env("NINJA_STATUS", "[%f/%t] ");
    if !target.cross {
        ninja_cmd.args(prefix::HOST_TOOLS);
    }
    crate::process::logged(
        ninja_cmd,
        &build_dir.join("kiln-build.log"),
        "building the IREE runtime",
        Some(parse_ninja_status),
    )?;

    smoke_test_probe(&build_dir, target)?;

    let dest = cache.publish(&dest, |staging| {
        let id = Identity {
            version: &pins.iree.version,
            revision: &pins.iree.revision,
            target: target.triple,
        };
        prefix::install(&build_dir, &source, staging, &id)?;
        let share = staging.join("share").join("kiln");
        std::fs::create_dir_all(&share)?;
        // What went into this prefix, for whoever wonders why it was rebuilt.
        std::fs::write(
            share.join("inputs.json"),
            serde_json::to_string_pretty(&inputs)?,
        )?;
        Ok(())
    })?;
    std::fs::remove_dir_all(&build_dir).ok();
    eprintln!(
        "built the IREE prefix ({what}) in {:.1}s: {}",
        started.elapsed().as_secs_f64(),
        dest.display()
    );
    Ok(dest)
}

/// The CUDA prefix the gate links against: for the host, `KILN_IREE_PREFIX`
/// when the environment provides one (`nix develop`, the flake's checks);
/// otherwise the one `cargo xtask iree --cuda [--target T]` builds for the
/// current pins (an environment's prefix is the host's, never a cross one).
pub fn gate_prefix(target: &Target) -> Result<PathBuf> {
    match std::env::var_os("KILN_IREE_PREFIX") {
        Some(prefix) if !prefix.is_empty() && !target.cross => Ok(PathBuf::from(prefix)),
        _ => build(
            &Cache::open()?,
            &Pins::of_checkout()?,
            Variant::Cuda,
            target,
        ),
    }
}

/// `IREE_CUDA_DEPS_DIR`: `include/cuda.h`, nvcc's `include/crt`, CCCL's
/// `include/nv` and `nvvm/libdevice`, assembled from the pinned CUDA wheels
/// by the `layout` of each.
fn cuda_deps_dir(cache: &Cache, pins: &Pins, system: &str) -> Result<PathBuf> {
    let key = content_key(&json!({ "system": system, "wheels": pins.cuda.wheels }));
    let dir = cache.path("cuda-deps").join(&key[..16]);
    cache.publish(&dir, |staging| {
        for (name, wheel) in &pins.cuda.wheels {
            let pin = for_system(&wheel.systems, system, &format!("CUDA {name} wheel"))?;
            let archive = fetch(cache, pin)?;
            let unpacked = tempfile::tempdir_in(cache.path("staging"))?;
            unpack::wheel(&archive, unpacked.path())?;
            for (from, to) in &wheel.layout {
                build_support::tree::copy_tree(&unpacked.path().join(from), &staging.join(to))
                    .with_context(|| format!("CUDA {name} wheel: cannot copy {from} to {to}"))?;
            }
        }
        Ok(())
    })
}

/// Runs the freshly linked probe on `local-sync` (under emulation for another
/// architecture): the runtime must create a device and a session before it
/// becomes a prefix.
fn smoke_test_probe(build_dir: &Path, target: &Target) -> Result<()> {
    let probe = build_dir.join("kiln_iree_link_probe");
    crate::process::read(target.runner(&probe)?.arg("local-sync"))
        .context("the IREE link probe built but failed to run on local-sync")?;
    Ok(())
}

/// `[12/253] …` from ninja's status line.
fn parse_ninja_status(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix('[')?;
    let (done, rest) = rest.split_once('/')?;
    let (total, _) = rest.split_once(']')?;
    Some((done.parse().ok()?, total.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::AARCH64;

    #[test]
    fn a_cross_prefix_has_a_key_and_folder_of_its_own() {
        let cache = tempfile::tempdir().unwrap();
        let cache = Cache::at(cache.path());
        let pins = Pins::of_checkout().unwrap();
        let host = Target::host().unwrap();
        let aarch64 = Target::parse(Some(AARCH64)).unwrap();
        if !aarch64.cross {
            eprintln!("skipped: this machine is aarch64, so no cross prefix is built here");
            return;
        }
        // The cross compilers' identities are part of the key. `cargo xtask
        // setup` installs them; Nix's build sandbox has none.
        if which::which(aarch64.cc()).is_err() {
            eprintln!(
                "skipped: no {} on PATH to key a cross prefix with (`cargo xtask setup` installs it)",
                aarch64.cc()
            );
            return;
        }
        for variant in [Variant::Cpu, Variant::Cuda] {
            let (native, native_inputs) = prefix_location(&cache, &pins, variant, &host).unwrap();
            let (cross, cross_inputs) = prefix_location(&cache, &pins, variant, &aarch64).unwrap();
            assert_ne!(native, cross);
            let name = cross.file_name().unwrap().to_str().unwrap();
            assert!(
                name.starts_with(&format!("aarch64-linux-{}-", variant.name())),
                "{name}"
            );
            assert_eq!(cross_inputs["target"], AARCH64);
            assert_eq!(native_inputs["target"], host.triple);
            // The cross compilers and the toolchain file are part of the key.
            assert!(
                cross_inputs["c_toolchain"][0]
                    .as_str()
                    .unwrap()
                    .contains("aarch64-linux-gnu-gcc"),
                "{}",
                cross_inputs["c_toolchain"]
            );
            assert!(
                cross_inputs["cmake_project"]
                    .to_string()
                    .contains("aarch64-linux-gnu.cmake")
            );
        }
    }
}
