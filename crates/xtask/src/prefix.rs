//! Installs a self-describing IREE prefix from a finished build of
//! `nix/iree-prefix` — the one installer both `cargo xtask iree` and the Nix
//! derivation run, so both produce the same layout:
//!
//! ```text
//! include/iree/...            the runtime's public headers (runtime/src/**/*.h)
//! lib/lib*.a                  the archives the link needs, and no others
//! lib/pkgconfig/iree-runtime.pc   how to link them, in order, and the target
//! bin/iree-flatcc-cli, bin/iree-c-embed-data   IREE's code generators (a
//!                             host build only: cross builds run them from here)
//! ```
//!
//! The archive list comes from the build, never from a list typed here: the
//! order is the link probe's link line as CMake computed it (read through
//! CMake's file API), and the set is the archives the linker actually took
//! members from (read from the probe's link map). IREE's per-library archives
//! repeat what the unified runtime archive holds, so the linker never opens
//! them and they are left out.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use serde_json::Value;

use crate::pins::{Pins, default_pin_file};

/// The pkg-config package the prefix describes; kiln-iree's build script asks
/// for the same name.
pub const PKG_CONFIG_NAME: &str = "iree-runtime";
/// The CMake target whose link line is the recipe (see nix/iree-prefix).
const PROBE: &str = "kiln_iree_link_probe";

/// The code generators IREE's build runs, installed from a host build so that
/// a cross build can run them (its `IREE_HOST_BIN_DIR`).
pub const HOST_TOOLS: [&str; 2] = ["iree-flatcc-cli", "iree-c-embed-data"];
/// Where the prefix keeps them.
pub const HOST_TOOLS_DIR: &str = "bin";

/// Everything the installer needs to know that the build does not record.
pub struct Identity<'a> {
    pub version: &'a str,
    pub revision: &'a str,
    /// The Rust target triple the archives were compiled for.
    pub target: &'a str,
}

/// `cargo xtask iree-prefix-install` (the Nix derivation's installer).
#[derive(clap::Args)]
pub struct InstallArgs {
    #[arg(long)]
    build: PathBuf,
    #[arg(long)]
    source: PathBuf,
    #[arg(long)]
    out: PathBuf,
    #[arg(long)]
    pins: Option<PathBuf>,
    /// The Rust target triple the build compiled for (default: this machine's).
    #[arg(long)]
    target: Option<String>,
}

/// Installs the prefix `args` name, for the pins and target they name.
pub fn install_from(args: InstallArgs) -> Result<()> {
    let pins = Pins::load(&args.pins.unwrap_or_else(default_pin_file))?;
    let id = Identity {
        version: &pins.iree.version,
        revision: &pins.iree.revision,
        target: crate::target::Target::parse(args.target.as_deref())?.triple,
    };
    install(&args.build, &args.source, &args.out, &id)
}

pub fn install(build: &Path, iree_source: &Path, out: &Path, id: &Identity) -> Result<()> {
    let fragments = probe_link_fragments(build)?;
    let used = archives_in_link_map(build, &build.join(format!("{PROBE}.map")))?;
    let drivers = enabled_hal_drivers(&build.join("CMakeCache.txt"))?;

    let libdir = out.join("lib");
    std::fs::create_dir_all(libdir.join("pkgconfig"))?;
    let mut libs: Vec<String> = Vec::new();
    for fragment in fragments {
        let flag = if fragment.ends_with(".a") {
            let archive = absolute(build, &fragment);
            if !used.contains(&archive) {
                continue;
            }
            let file_name = archive
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| anyhow!("odd archive path {fragment}"))?;
            let name = file_name
                .strip_prefix("lib")
                .and_then(|n| n.strip_suffix(".a"))
                .ok_or_else(|| anyhow!("archive {file_name} is not named lib*.a"))?;
            std::fs::copy(&archive, libdir.join(file_name))
                .with_context(|| format!("cannot copy {}", archive.display()))?;
            format!("-l{name}")
        } else {
            // System libraries (-lm, -ldl) and flags such as -pthread.
            fragment
        };
        if !libs.contains(&flag) {
            libs.push(flag);
        }
    }
    if !libs.iter().any(|l| l.starts_with("-liree_")) {
        return Err(anyhow!(
            "the link map of {PROBE} names no IREE archive; is {} from a finished build?",
            build.display()
        ));
    }

    let headers = copy_headers(
        &iree_source.join("runtime").join("src"),
        &out.join("include"),
    )?;
    let tools = copy_host_tools(build, &out.join(HOST_TOOLS_DIR))?;
    let pc = pkg_config_file(id, &drivers, &libs);
    std::fs::write(
        libdir
            .join("pkgconfig")
            .join(format!("{PKG_CONFIG_NAME}.pc")),
        pc,
    )?;
    eprintln!(
        "installed the IREE prefix for {}: {} headers, link: {}, drivers: {}, tools: {}",
        id.target,
        headers,
        libs.join(" "),
        drivers.join(" "),
        tools.join(" ")
    );
    Ok(())
}

/// The `.pc` text. `${pcfiledir}` keeps the prefix relocatable: the gate
/// mutates copies of it.
fn pkg_config_file(id: &Identity, drivers: &[String], libs: &[String]) -> String {
    let Identity {
        version,
        revision,
        target,
    } = id;
    format!(
        "prefix=${{pcfiledir}}/../..
libdir=${{prefix}}/lib
includedir=${{prefix}}/include
iree_version={version}
iree_revision={revision}
target={target}
hal_drivers={}

Name: {PKG_CONFIG_NAME}
Description: IREE runtime {version} built from source for kiln
Version: {version}
Cflags: -I${{includedir}}
Libs: -L${{libdir}} {}
",
        drivers.join(" "),
        libs.join(" ")
    )
}

/// The probe's link libraries, in link order, from CMake's file API
/// (codemodel v2, which nix/iree-prefix/CMakeLists.txt asks for): the
/// reply's index names the code model, which names the probe's target file.
fn probe_link_fragments(build: &Path) -> Result<Vec<String>> {
    let reply = build.join(".cmake/api/v1/reply");
    let index_path = std::fs::read_dir(&reply)
        .with_context(|| format!("no CMake file-API reply in {}", reply.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("index-"))
        })
        .max()
        .ok_or_else(|| anyhow!("no index-*.json in {}", reply.display()))?;
    let index = read_json(&index_path)?;
    let codemodel_file = index
        .pointer("/reply/codemodel-v2/jsonFile")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("the CMake file-API reply has no codemodel-v2"))?;
    let codemodel = read_json(&reply.join(codemodel_file))?;
    let target_file = codemodel["configurations"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["targets"].as_array().into_iter().flatten())
        .find(|t| t["name"] == PROBE)
        .and_then(|t| t["jsonFile"].as_str())
        .ok_or_else(|| anyhow!("the CMake code model has no target {PROBE}"))?;
    let target = read_json(&reply.join(target_file))?;
    let fragments = target
        .pointer("/link/commandFragments")
        .ok_or_else(|| anyhow!("{PROBE} has no link step in the code model"))?;
    Ok(fragments
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["role"] == "libraries")
        .filter_map(|f| f["fragment"].as_str())
        .flat_map(|fragment| fragment.split_whitespace().map(str::to_string))
        .collect())
}

/// The archives the linker took at least one member from, as named in a GNU
/// ld or lld map file (`path/libfoo.a(member.o)`).
fn archives_in_link_map(build: &Path, map: &Path) -> Result<BTreeSet<PathBuf>> {
    let text = std::fs::read_to_string(map).with_context(|| {
        format!(
            "cannot read the link map {} (the probe links with -Map)",
            map.display()
        )
    })?;
    Ok(text
        .split_whitespace()
        .filter_map(|token| token.find(".a(").map(|i| &token[..i + 2]))
        .map(|path| absolute(build, path))
        .collect())
}

/// The HAL drivers the build enabled (`IREE_HAL_DRIVER_CUDA:BOOL=ON` → `cuda`).
fn enabled_hal_drivers(cache: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(cache)
        .with_context(|| format!("cannot read {}", cache.display()))?;
    let mut drivers: Vec<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("IREE_HAL_DRIVER_"))
        .filter_map(|rest| rest.split_once(":BOOL=ON"))
        .map(|(name, _)| name)
        .filter(|name| *name != "DEFAULTS")
        .map(|name| name.to_lowercase().replace('_', "-"))
        .collect();
    drivers.sort();
    if drivers.is_empty() {
        return Err(anyhow!("{} enables no IREE HAL driver", cache.display()));
    }
    Ok(drivers)
}

/// Copies the code generators a build made (IREE writes them to
/// `iree/tools`); a cross build makes none. Returns the names copied.
fn copy_host_tools(build: &Path, dest: &Path) -> Result<Vec<&'static str>> {
    let mut copied = Vec::new();
    for tool in HOST_TOOLS {
        let built = build.join("iree").join("tools").join(tool);
        if built.is_file() {
            std::fs::create_dir_all(dest)?;
            std::fs::copy(&built, dest.join(tool))
                .with_context(|| format!("cannot copy {}", built.display()))?;
            copied.push(tool);
        }
    }
    Ok(copied)
}

/// Copies every `*.h` under `src` to the same relative path under `dest`.
fn copy_headers(src: &Path, dest: &Path) -> Result<usize> {
    let mut count = 0;
    for entry in walkdir::WalkDir::new(src) {
        let entry = entry?;
        if entry.file_type().is_file() && entry.path().extension().is_some_and(|e| e == "h") {
            let relative = entry.path().strip_prefix(src)?;
            let target = dest.join(relative);
            std::fs::create_dir_all(target.parent().expect("a file has a parent"))?;
            std::fs::copy(entry.path(), &target)?;
            count += 1;
        }
    }
    Ok(count)
}

fn absolute(base: &Path, path: &str) -> PathBuf {
    let path = Path::new(path);
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    };
    joined.canonicalize().unwrap_or(joined)
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is malformed", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_description_names_the_target() {
        let id = Identity {
            version: "3.11.0",
            revision: "abc",
            target: "aarch64-unknown-linux-gnu",
        };
        let pc = pkg_config_file(&id, &["local-task".into()], &["-lfoo".into()]);
        assert!(
            pc.lines().any(|l| l == "target=aarch64-unknown-linux-gnu"),
            "{pc}"
        );
    }

    #[test]
    fn the_code_generators_a_build_made_are_installed() {
        let build = tempfile::tempdir().unwrap();
        let tools = build.path().join("iree/tools");
        std::fs::create_dir_all(&tools).unwrap();
        std::fs::write(tools.join("iree-flatcc-cli"), "flatcc").unwrap();
        let out = tempfile::tempdir().unwrap();
        let bin = out.path().join(HOST_TOOLS_DIR);
        // A cross build made none of them (it ran the host's).
        assert!(copy_host_tools(out.path(), &bin).unwrap().is_empty());
        assert!(!bin.exists());
        assert_eq!(
            copy_host_tools(build.path(), &bin).unwrap(),
            ["iree-flatcc-cli"]
        );
        assert_eq!(
            std::fs::read_to_string(bin.join("iree-flatcc-cli")).unwrap(),
            "flatcc"
        );
    }
}
