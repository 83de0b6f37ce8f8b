//! `cargo xtask test` (the README's test command) and `cargo xtask verify-pins`.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::iree::{self, Variant};
use crate::pins::{Download, Pins, repo_root};
use crate::{compiler, tools};

/// Every step of the suite, in order; the first failure stops it.
pub fn run(cache: &Cache, pins: &Pins) -> Result<()> {
    tools::require_host_program(
        "pkg-config",
        "kiln-iree's build script reads the prefix's link description with it",
        "Debian/Ubuntu: apt-get install -y pkg-config",
    )?;
    let cpu_prefix = step("IREE prefix, CPU drivers", || {
        iree::build(cache, pins, Variant::Cpu)
    })?;
    let cuda_prefix = step("IREE prefix, CUDA driver", || {
        iree::build(cache, pins, Variant::Cuda)
    })?;
    let compiler = step("iree-compile", || compiler::install(cache, pins))?;

    let env = |prefix: &Path| -> Vec<(&'static str, OsString)> {
        vec![
            ("KILN_IREE_PREFIX", prefix.into()),
            ("KILN_IREE_COMPILE", compiler.clone().into()),
        ]
    };
    step("rustfmt", || cargo(&["fmt", "--all", "--check"], &[]))?;
    step("clippy (cuda,xla-iree, all targets)", || {
        cargo(
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--locked",
                "--features",
                "cuda,xla-iree",
                "--",
                "-D",
                "warnings",
            ],
            &env(&cuda_prefix),
        )
    })?;
    step("tests on the CPU-only prefix", || {
        cargo(&["test", "--workspace", "--locked"], &env(&cpu_prefix))
    })?;
    step("tests with --features cuda,xla-iree", || {
        cargo(
            &[
                "test",
                "--workspace",
                "--locked",
                "--features",
                "cuda,xla-iree",
            ],
            &env(&cuda_prefix),
        )
    })?;
    step("the gate: link check and mutation suite", || {
        crate::gate::run(&cuda_prefix, false, None)
    })?;
    eprintln!("xtask test: every step succeeded");
    Ok(())
}

/// Downloads every pinned input for every system and checks its hash.
pub fn verify_pins(cache: &Cache, pins: &Pins) -> Result<()> {
    let mut all: Vec<&Download> = vec![&pins.iree.source.download];
    all.extend(pins.iree.compiler.wheels.values());
    for wheel in pins.cuda.wheels.values() {
        all.extend(wheel.systems.values());
    }
    all.extend(pins.tools.cmake.systems.values());
    all.extend(pins.tools.ninja.systems.values());
    for pin in &all {
        fetch(cache, pin)?;
        println!("ok  {}  {}", pin.sha256, pin.name);
    }
    println!("{} pinned inputs verified", all.len());
    Ok(())
}

fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    eprintln!("==> {name}");
    let started = Instant::now();
    let result = f().with_context(|| format!("step failed: {name}"));
    eprintln!(
        "<== {name}: {} in {:.1}s",
        if result.is_ok() { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    result
}

/// Runs the cargo that runs xtask, in the repository root.
fn cargo(args: &[&str], env: &[(&str, OsString)]) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(repo_root())
        .status()
        .context("cannot run cargo")?;
    if !status.success() {
        return Err(anyhow!("`cargo {}` failed ({status})", args.join(" ")));
    }
    Ok(())
}
