//! `cargo xtask test`: the README's test command.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};

use crate::cache::Cache;
use crate::iree::{self, Variant};
use crate::pins::{Pins, repo_root};
use crate::target::{AARCH64, Target};
use crate::{compiler, disk, tools};

/// Every step of the suite, in order; the first failure stops it. With
/// `with_aarch64`, the GB10's architecture too (cross-built, emulated).
pub fn run(cache: &Cache, pins: &Pins, with_aarch64: bool) -> Result<()> {
    disk::warn_if_short();
    let toolbox = step("setup: system packages and pinned tools", || {
        crate::setup::run(cache)
    })?;
    tools::require_host_program(
        "pkg-config",
        "kiln-iree's build script reads the prefix's link description with it",
        "Debian/Ubuntu: apt-get install -y pkg-config",
    )?;
    let host = Target::host()?;
    let cpu_prefix = step("IREE prefix, CPU drivers", || {
        iree::build(cache, pins, Variant::Cpu, &host)
    })?;
    let cuda_prefix = step("IREE prefix, CUDA driver", || {
        iree::build(cache, pins, Variant::Cuda, &host)
    })?;
    // The GB10's architecture, cross-built here (unless this is one): its
    // CUDA prefix serves both its gate and its emulated tests, which run the
    // gate's own test executables.
    let aarch64 = Target::parse(Some(AARCH64))?;
    let aarch64_prefix = if with_aarch64 && aarch64.cross {
        Some(step("IREE prefix, CUDA driver, aarch64 (cross)", || {
            iree::build(cache, pins, Variant::Cuda, &aarch64)
        })?)
    } else {
        None
    };
    let (compiler, _) = step("iree-compile", || compiler::install(cache, pins))?;

    let env = |prefix: &Path| -> Vec<(&'static str, OsString)> {
        vec![
            ("KILN_IREE_PREFIX", prefix.into()),
            ("KILN_IREE_COMPILE", compiler.clone().into()),
        ]
    };
    step("rustfmt", || cargo(&["fmt", "--all", "--check"], &[]))?;
    step("Nix files: parse, format, dead code", || {
        crate::lint_nix::run(&toolbox)
    })?;
    step(
        "Nix evaluation summary matches the Nix files",
        crate::eval_nix::check,
    )?;
    step("GitHub workflows: invariants, actionlint, zizmor", || {
        crate::lint_workflows::run(&toolbox)
    })?;
    step(
        "every pinned input, every system: download and sha256",
        || crate::verify_pins::run(cache, pins),
    )?;
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
    step(
        "ptxas: every prepared kernel for every pinned capability",
        || {
            let tools = crate::ptxas::Tools {
                bench: crate::ptxas::build_bench(&cuda_prefix)?,
                compiler: compiler.clone(),
                ptxas: crate::ptxas::pinned_ptxas(cache, pins)?,
            };
            crate::ptxas::run(
                &tools,
                &pins.cuda.capabilities,
                &repo_root().join("target/ptxas"),
            )
        },
    )?;
    step("kiln-server with the official OpenAI Python client", || {
        openai_client(cache)
    })?;
    step("the gate: link check and mutation suite", || {
        crate::gate::run(&cuda_prefix, &host, &Default::default())
    })?;
    if let Some(prefix) = &aarch64_prefix {
        // The emulated tests run the link check's executables, before the
        // mutants: they share the link check's artifact names, so after them
        // the workspace crates would be rebuilt.
        step("the aarch64 link check", || {
            crate::gate::run(
                prefix,
                &aarch64,
                &crate::gate::Options {
                    link_only: true,
                    ..Default::default()
                },
            )
        })?;
        step(
            "aarch64 tests under qemu-aarch64: kiln-core, xla_prepared_prefill on local-task",
            || crate::emulated::run(prefix, &compiler, &aarch64),
        )?;
        step(
            "the gate for aarch64: link check (current) and mutation suite",
            || crate::gate::run(prefix, &aarch64, &Default::default()),
        )?;
    }
    step("reproducible release binaries", || {
        crate::repro::run(&cuda_prefix)
    })?;
    eprintln!("xtask test: every step succeeded");
    Ok(())
}

/// Builds `kiln` and `kiln-server` (default features) and runs
/// tests/openai_client.py against them in the `openai` venv.
fn openai_client(cache: &Cache) -> Result<()> {
    cargo(
        &["build", "--locked", "--bin", "kiln", "--bin", "kiln-server"],
        &[],
    )?;
    let python = crate::setup::openai_python(cache)?;
    let root = repo_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin = target.join("debug");
    let status = Command::new(&python)
        .arg(root.join("tests/openai_client.py"))
        .arg(bin.join("kiln-server"))
        .arg(bin.join("kiln"))
        .current_dir(&root)
        .status()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !status.success() {
        return Err(anyhow!("tests/openai_client.py failed ({status})"));
    }
    Ok(())
}

fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    eprintln!("==> {name}");
    let started = Instant::now();
    let result = f().with_context(|| format!("step failed: {name}"));
    eprintln!(
        "<== {name}: {} in {:.1}s ({})",
        if result.is_ok() { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64(),
        disk::free_space_line(),
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
