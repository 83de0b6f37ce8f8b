//! `cargo xtask ptxas`: the pinned GPU capabilities as a property of kiln's
//! kernels. kiln's CUDA modules carry sm_80 PTX that the driver assembles for
//! the real GPU at load time; this assembles it here first, with the pinned
//! CUDA's `ptxas`, for every pinned capability (sm_121, the GB10; sm_90, the
//! H200). It prepares every module of the embedded model and of TinyLlama's
//! shape at f32 and f16 (`kiln-bench-decode --prepare`) through a compiler
//! wrapper that adds
//! `--iree-hal-dump-executable-binaries-to`, assembles each dumped `.ptx`
//! with `ptxas -v --gpu-name sm_XY`, fails if ptxas rejects any kernel, and
//! reports registers, spills and shared memory per kernel.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, anyhow};
use serde::Serialize;

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Pins, default_pin_file, for_system, repo_root};
use crate::target::Target;

/// The models whose modules are assembled: kiln's embedded model and
/// TinyLlama-1.1B's shape (a random-weight model of kiln-bench-decode).
const MODELS: [&str; 2] = ["embedded", "tinyllama-1.1b"];
const PRECISIONS: [&str; 2] = ["f32", "f16"];

/// What to run, each built or pinned here unless given: kiln-bench-decode
/// (its `--prepare` compiles every module a model needs), the compiler and
/// ptxas; and the folder of kiln's own kernels, whose PTX the modules embed.
#[derive(clap::Args, Default)]
pub struct Args {
    /// kiln-bench-decode built with cuda,xla-iree (default: built here).
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// iree-compile (default: the pinned one, installed here).
    #[arg(long)]
    pub compiler: Option<PathBuf>,
    /// ptxas (default: the pinned nvcc wheel's).
    #[arg(long)]
    pub ptxas: Option<PathBuf>,
    /// The folder of kiln's own kernels and their PTX (default: this
    /// checkout's crates/kiln-xla/kernels).
    #[arg(long)]
    pub kernels: Option<PathBuf>,
    /// The pin file (default: this checkout's).
    #[arg(long)]
    pub pins: Option<PathBuf>,
    /// Where report.json goes (default: target/ptxas).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Serialize, Default)]
struct Kernel {
    capability: String,
    module: String,
    kernel: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    shared_bytes: u32,
    stack_bytes: u32,
}

/// The pinned CUDA's ptxas, unpacked from the pinned nvcc wheel.
pub fn pinned_ptxas(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    let wheel = pins
        .cuda
        .wheels
        .get("nvcc")
        .ok_or_else(|| anyhow!("nix/pins.json pins no nvcc wheel (cuda.wheels.nvcc)"))?;
    let member = wheel.ptxas.as_ref().ok_or_else(|| {
        anyhow!("nix/pins.json: cuda.wheels.nvcc.ptxas must name ptxas inside the wheel")
    })?;
    let pin = for_system(&wheel.systems, Target::host()?.system, "CUDA nvcc wheel")?;
    let dir = cache.path("ptxas").join(&pin.sha256[..16]);
    let dir = cache.publish(&dir, |staging| {
        let archive = fetch(cache, pin)?;
        build_support::unpack::wheel_members(&archive, staging, std::slice::from_ref(member))
    })?;
    Ok(dir.join(member))
}

/// Builds kiln-bench-decode with cuda,xla-iree (debug: it only compiles
/// modules) against `prefix`; returns its path.
pub fn build_bench(prefix: &Path) -> Result<PathBuf> {
    let target = crate::process::target_dir();
    let build = "build --locked --features cuda,xla-iree --bin kiln-bench-decode";
    crate::process::run(
        crate::process::cargo()
            .args(build.split(' '))
            .current_dir(repo_root())
            .env("CARGO_TARGET_DIR", &target)
            .env("KILN_IREE_PREFIX", prefix),
        "building kiln-bench-decode",
    )?;
    Ok(target.join("debug/kiln-bench-decode"))
}

/// `sm_121` from the capability `12.1`.
fn gpu_name(capability: &str) -> Result<String> {
    let (major, minor) = capability
        .split_once('.')
        .ok_or_else(|| anyhow!("capability {capability:?} is not MAJOR.MINOR"))?;
    Ok(format!("sm_{major}{minor}"))
}

pub fn run(args: Args) -> Result<()> {
    let pins = Pins::load(&args.pins.unwrap_or_else(default_pin_file))?;
    // Each tool as given, else built or installed here (in this order).
    let build = || build_bench(&crate::iree::gate_prefix(&Target::host()?)?);
    let install = || crate::compiler::install(&Cache::open()?, &pins).map(|(path, _)| path);
    let unpack = || pinned_ptxas(&Cache::open()?, &pins);
    let bench = args.bench.map_or_else(build, Ok)?;
    let compiler = args.compiler.map_or_else(install, Ok)?;
    let ptxas = args.ptxas.map_or_else(unpack, Ok)?;
    let kernels_dir = args.kernels.unwrap_or_else(crate::kernels::folder);
    let out = args.out.unwrap_or_else(|| repo_root().join("target/ptxas"));
    let work = tempfile::tempdir()?;
    let dumps = work.path().join("dumps");
    std::fs::create_dir_all(&dumps)?;
    let wrapper = work.path().join("iree-compile");
    // Each compile dumps into a folder of its own (executables of different
    // modules share names).
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\ncase \"$1\" in --version) exec '{0}' \"$@\";; esac\n\
             dir='{1}'/$$\nmkdir -p \"$dir\"\nexec '{0}' \"$@\" --iree-hal-dump-executable-binaries-to=\"$dir\"\n",
            compiler.display(),
            dumps.display()
        ),
    )?;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;

    let mut command = Command::new(&bench);
    command.args(["--prepare", "--backend", "iree-cuda"]);
    for model in MODELS {
        command.args(["--model", model]);
    }
    for precision in PRECISIONS {
        command.args(["--precision", precision]);
    }
    crate::process::read(
        command
            .env("KILN_IREE_COMPILE", &wrapper)
            // A module cache of its own, so that every module is compiled.
            .env("KILN_CACHE_DIR", work.path().join("cache")),
    )?;

    let mut ptx_files = Vec::new();
    for entry in walkdir::WalkDir::new(&dumps) {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "ptx") {
            ptx_files.push(entry.into_path());
        }
    }
    ptx_files.sort();
    if ptx_files.is_empty() {
        return Err(anyhow!(
            "iree-compile dumped no .ptx: did `--iree-hal-dump-executable-binaries-to` change?"
        ));
    }
    // kiln's own kernels, which the modules embed as they are.
    let own = crate::kernels::sources(&kernels_dir)?.into_iter();
    ptx_files.extend(own.map(|source| source.with_extension("ptx")));

    let mut kernels = Vec::new();
    let mut rejected = Vec::new();
    for capability in &pins.cuda.capabilities {
        let gpu = gpu_name(capability)?;
        for (index, ptx) in ptx_files.iter().enumerate() {
            // Every module's file has the same name; number them. kiln's
            // own kernels go by their file's name.
            let module = match ptx.strip_prefix(&kernels_dir) {
                Ok(file) => file.display().to_string(),
                Err(_) => format!("module{index}"),
            };
            let (status, text) = crate::process::output_text(
                Command::new(&ptxas)
                    .args(["-v", "--gpu-name", &gpu, "-o"])
                    .arg(work.path().join("out.cubin"))
                    .arg(ptx),
            )?;
            if !status.success() {
                rejected.push(format!("{gpu} {module}: {}", text.trim()));
                continue;
            }
            kernels.extend(parse_verbose(&text, &gpu, &module));
        }
    }

    std::fs::create_dir_all(&out)?;
    std::fs::write(
        out.join("report.json"),
        serde_json::to_string_pretty(&kernels)?,
    )?;
    print_report(&kernels, ptx_files.len());
    if !rejected.is_empty() {
        return Err(anyhow!(
            "ptxas rejected {} module(s):\n{}",
            rejected.len(),
            rejected.join("\n")
        ));
    }
    eprintln!("report: {}", out.join("report.json").display());
    Ok(())
}

fn print_report(kernels: &[Kernel], modules: usize) {
    let mut per_capability: BTreeMap<&str, (usize, u32, u32, u32)> = BTreeMap::new();
    for k in kernels {
        println!(
            "{:<7} {:<48} regs {:>3}  spill {:>4}/{:<4} smem {:>6}  stack {:>5}",
            k.capability,
            format!("{}::{}", k.module, k.kernel),
            k.registers,
            k.spill_stores,
            k.spill_loads,
            k.shared_bytes,
            k.stack_bytes
        );
        let e = per_capability.entry(&k.capability).or_default();
        e.0 += 1;
        e.1 = e.1.max(k.registers);
        e.2 += k.spill_stores + k.spill_loads;
        e.3 = e.3.max(k.shared_bytes);
    }
    for (capability, (count, regs, spills, smem)) in per_capability {
        println!(
            "ptxas {capability}: {count} kernels from {modules} PTX files assembled; max {regs} registers, {spills} bytes spilled in all, max {smem} bytes shared memory"
        );
    }
}

/// Kernels from `ptxas -v` output: a "Compiling entry function 'K' for
/// 'sm_XY'" line, then "Function properties for K" (stack, spills) and
/// "Used N registers, … M bytes smem".
fn parse_verbose(text: &str, gpu: &str, module: &str) -> Vec<Kernel> {
    let mut kernels = Vec::new();
    let mut current: Option<Kernel> = None;
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.trim_end().ends_with(unit))
            .and_then(|part| part.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    for line in text.lines() {
        let line = line
            .trim()
            .trim_start_matches("ptxas info")
            .trim_start()
            .trim_start_matches(':')
            .trim();
        if let Some(rest) = line.strip_prefix("Compiling entry function '") {
            if let Some(done) = current.take() {
                kernels.push(done);
            }
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            current = Some(Kernel {
                capability: gpu.to_string(),
                module: module.to_string(),
                kernel: name,
                ..Default::default()
            });
        } else if let Some(kernel) = current.as_mut() {
            if line.contains("bytes stack frame") {
                kernel.stack_bytes = number_before(line, "bytes stack frame");
                kernel.spill_stores = number_before(line, "bytes spill stores");
                kernel.spill_loads = number_before(line, "bytes spill loads");
            } else if line.starts_with("Used ") {
                kernel.registers = line
                    .strip_prefix("Used ")
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                kernel.shared_bytes = number_before(line, "bytes smem");
            }
        }
    }
    kernels.extend(current);
    kernels
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbose_output_gives_registers_spills_and_shared_memory() {
        let text = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'decode_dispatch_3' for 'sm_121'\n\
            ptxas info    : Function properties for decode_dispatch_3\n\
            \x20   16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
            ptxas info    : Used 40 registers, used 0 barriers, 2048 bytes smem, 380 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'k2' for 'sm_121'\n\
            ptxas info    : Function properties for k2\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 12 registers, 360 bytes cmem[0]\n";
        let kernels = parse_verbose(text, "sm_121", "m");
        assert_eq!(kernels.len(), 2);
        let k = &kernels[0];
        assert_eq!(
            (
                k.kernel.as_str(),
                k.registers,
                k.spill_stores,
                k.spill_loads,
                k.shared_bytes,
                k.stack_bytes
            ),
            ("decode_dispatch_3", 40, 8, 4, 2048, 16)
        );
        assert_eq!((kernels[1].registers, kernels[1].shared_bytes), (12, 0));
    }

    #[test]
    fn capabilities_become_gpu_names() {
        assert_eq!(gpu_name("12.1").unwrap(), "sm_121");
        assert_eq!(gpu_name("9.0").unwrap(), "sm_90");
        assert!(gpu_name("sm_90").is_err());
    }
}
