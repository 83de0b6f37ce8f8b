//! `cargo xtask test`: the README's test command.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;

use crate::cache::Cache;
use crate::iree::{self, Variant};
use crate::pins::{Pins, repo_root};
use crate::steps::{Keyed, Reads, Runner};
use crate::target::{AARCH64, Target};
use crate::{compiler, disk, tools};

/// What `cargo xtask test` runs.
#[derive(clap::Args)]
pub struct Plan {
    /// Leave out the GB10's architecture: the cross-built aarch64 prefix,
    /// the aarch64 gate and the aarch64 tests under qemu (about 20 minutes
    /// of a cold run on 2 cores). CI runs them; this is for a quicker local run.
    #[arg(long)]
    pub skip_aarch64: bool,
    /// The developer loop (about 10 minutes warm): rustfmt, clippy, the CPU
    /// tests and the link check, nothing else.
    #[arg(long)]
    pub quick: bool,
    /// Defer (loudly; never reported as passed) the expensive steps that
    /// would end the run past this many minutes: ptxas, the aarch64 steps,
    /// repro. CI gives 80.
    #[arg(long)]
    pub budget_minutes: Option<u64>,
}

/// What a step reads, beyond the toolchain and xtask's own code (with the
/// plumbing it runs on): the Nix files and the linter's code; the workflows,
/// CI scripts and their linter; the pins.
fn xtask_code(path: &Path) -> bool {
    path.starts_with("crates/xtask") || path.starts_with("crates/build-support")
}
fn nix_files(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "nix")
        || path.starts_with("crates/nix-harness")
        || xtask_code(path)
}
fn workflow_files(path: &Path) -> bool {
    [".github", ".ci", "crates/workflow-lint"]
        .iter()
        .any(|folder| path.starts_with(folder))
        || xtask_code(path)
}
fn pin_files(path: &Path) -> bool {
    path == Path::new("nix/pins.json") || xtask_code(path)
}

/// Every step of the suite, in order; the first failure stops it. Each
/// step's line says whether it ran, was reused or was deferred.
pub fn run(cache: &Cache, pins: &Pins, plan: &Plan) -> Result<()> {
    disk::warn_if_short();
    let budget = plan.budget_minutes.map(|m| Duration::from_secs(m * 60));
    let mut steps = Runner::new(cache, budget)?;
    let toolbox = steps.run("setup: system packages and pinned tools", || {
        crate::setup::run(cache, crate::setup::Scope::Suite)
    })?;
    tools::require_host_program(
        "pkg-config",
        "kiln-iree's build script reads the prefix's link description with it",
    )?;
    let host = Target::host()?;
    let prefix = |steps: &mut Runner, name: &str, variant: Variant, target: &Target| {
        let (folder, _) = iree::prefix_location(cache, pins, variant, target)?;
        steps.produce(name, &folder, || iree::build(cache, pins, variant, target))
    };
    let cpu_prefix = prefix(&mut steps, "IREE prefix, CPU drivers", Variant::Cpu, &host)?;
    let cuda_prefix = prefix(&mut steps, "IREE prefix, CUDA driver", Variant::Cuda, &host)?;
    // The GB10's architecture, cross-built here (unless this is one): its
    // CUDA prefix serves both its gate and its emulated tests, which run the
    // gate's own test executables.
    let aarch64 = Target::parse(Some(AARCH64))?;
    let aarch64_prefix = (!plan.skip_aarch64 && !plan.quick && aarch64.cross)
        .then(|| {
            let name = "IREE prefix, CUDA driver, aarch64 (cross)";
            prefix(&mut steps, name, Variant::Cuda, &aarch64)
        })
        .transpose()?;
    let compiler_folder = compiler::compiler_dir(cache, pins)?;
    let (compiler, _) = steps.produce("iree-compile", &compiler_folder, || {
        compiler::install(cache, pins)
    })?;

    let jinja_python = crate::setup::venv_python(cache, &crate::setup::JINJA_VENV)?;
    let reference_folder = crate::reference_files::folder(cache, pins)?;
    let reference_files = steps.produce("reference files", &reference_folder, || {
        crate::reference_files::provide(cache, pins)
    })?;
    // The workflow lint's guard-deletion test runs zizmor's half with it.
    let zizmor = toolbox.find("zizmor", "the workflow lint's guard-deletion test")?;
    let env = |prefix: &Path| -> Vec<(&'static str, OsString)> {
        vec![
            ("KILN_IREE_PREFIX", prefix.into()),
            ("KILN_IREE_COMPILE", compiler.clone().into()),
            ("KILN_REFERENCE_FILES", reference_files.clone().into()),
            ("KILN_JINJA_PYTHON", jinja_python.clone().into()),
            ("KILN_ZIZMOR", zizmor.clone().into()),
        ]
    };
    // Steps that read the whole checkout, keyed by it and by the prefix and
    // compiler they use (folders named by their own content keys).
    let whole = |name, prefix: &Path, cold_seconds| Keyed {
        name,
        reads: Reads::Everything,
        extra: vec![prefix.display().to_string(), compiler.display().to_string()],
        cold_seconds,
        deferrable: false,
        reusable: true,
    };
    // The expensive steps a short budget may leave out.
    let deferrable = |step: Keyed<'static>| Keyed {
        deferrable: true,
        ..step
    };
    steps.run("rustfmt", || cargo("fmt --all --check", &[]))?;
    steps.run("kernels' PTX from their source", || {
        crate::kernels::run(true)
    })?;
    if !plan.quick {
        // Lints, keyed by the files they read and the linters' folders.
        let lint = |name, reads| Keyed {
            name,
            reads: Reads::Only(reads),
            extra: vec![toolbox.identity()],
            cold_seconds: 30,
            deferrable: false,
            reusable: true,
        };
        steps.keyed(
            lint("Nix files: parse, format, dead code", nix_files),
            || crate::nix::lint(&toolbox),
        )?;
        steps.run(
            "Nix evaluation summary matches the Nix files",
            crate::nix::eval_check,
        )?;
        steps.keyed(
            lint(
                "GitHub workflows: invariants, actionlint, zizmor",
                workflow_files,
            ),
            || workflow_lint::run(&repo_root(), &|program, why| toolbox.find(program, why)),
        )?;
        steps.keyed(
            lint(
                "every pinned input, every system: download and sha256",
                pin_files,
            ),
            || crate::fetch::verify_pins(cache, pins),
        )?;
    }
    let clippy =
        "clippy --workspace --all-targets --locked --features cuda,xla-iree -- -D warnings";
    steps.keyed(
        whole("clippy (cuda,xla-iree, all targets)", &cuda_prefix, 120),
        || cargo(clippy, &env(&cuda_prefix)),
    )?;
    steps.keyed(
        whole("tests on the CPU-only prefix", &cpu_prefix, 250),
        || cargo("test --workspace --locked", &env(&cpu_prefix)),
    )?;
    let link_only = crate::gate::Options::link_only;
    if plan.quick {
        steps.keyed(
            whole("the link check (no mutation suite)", &cuda_prefix, 512),
            || crate::gate::run(&cuda_prefix, &host, &link_only()),
        )?;
        eprintln!("{}", steps.summary());
        eprintln!(
            "xtask test --quick: every step that ran succeeded; run `cargo xtask test` before you push"
        );
        return Ok(());
    }
    steps.keyed(
        whole("tests with --features cuda,xla-iree", &cuda_prefix, 385),
        || {
            let test = "test --workspace --locked --features cuda,xla-iree";
            cargo(test, &env(&cuda_prefix))
        },
    )?;
    let ptxas = "ptxas: every prepared kernel for every pinned capability";
    steps.keyed(deferrable(whole(ptxas, &cuda_prefix, 330)), || {
        crate::ptxas::run(crate::ptxas::Args {
            bench: Some(crate::ptxas::build_bench(&cuda_prefix)?),
            compiler: Some(compiler.clone()),
            ..Default::default()
        })
    })?;
    let openai = "kiln-server with the official OpenAI Python client";
    steps.keyed(whole(openai, &cpu_prefix, 60), || openai_client(cache))?;
    steps.keyed(
        whole("the gate: link check and mutation suite", &cuda_prefix, 512),
        || crate::gate::run(&cuda_prefix, &host, &Default::default()),
    )?;
    if let Some(prefix) = &aarch64_prefix {
        // The emulated tests run the link check's executables, before the
        // mutants: they share the link check's artifact names, so after them
        // the workspace crates would be rebuilt. One step, so that a deferral
        // leaves out all three or none.
        let name = "aarch64: link check, tests under qemu-aarch64 (kiln-core, kiln-cpu, \
                    xla_prepared_prefill on local-task), mutation suite";
        steps.keyed(deferrable(whole(name, prefix, 630)), || {
            crate::gate::run(prefix, &aarch64, &link_only())?;
            crate::emulated::run(prefix, &compiler, &aarch64)?;
            crate::gate::run(prefix, &aarch64, &Default::default())
        })?;
    }
    // Never reused: a verdict of identical builds must come from two builds
    // made now, sharing no cache (repro builds from two fresh checkouts).
    let repro = Keyed {
        reusable: false,
        ..deferrable(whole("reproducible release binaries", &cuda_prefix, 460))
    };
    steps.keyed(repro, || crate::repro::run(&cuda_prefix))?;
    eprintln!("{}", steps.summary());
    Ok(())
}

/// Builds `kiln` and `kiln-server` (default features) and runs
/// tests/openai_client.py against them in the `openai` venv.
fn openai_client(cache: &Cache) -> Result<()> {
    cargo("build --locked --bin kiln --bin kiln-server", &[])?;
    let python = crate::setup::venv_python(cache, &crate::setup::OPENAI_VENV)?;
    let root = repo_root();
    let bin = crate::process::target_dir().join("debug");
    crate::process::run(
        Command::new(&python)
            .arg(root.join("tests/openai_client.py"))
            .arg(bin.join("kiln-server"))
            .arg(bin.join("kiln"))
            .current_dir(&root),
        "tests/openai_client.py",
    )
}

/// Runs the cargo that runs xtask with `args` (split at spaces), in the
/// repository root, building where xtask looks for what it built.
fn cargo(args: &str, env: &[(&str, OsString)]) -> Result<()> {
    crate::process::run(
        crate::process::cargo()
            .args(args.split(' '))
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("CARGO_TARGET_DIR", crate::process::target_dir())
            .current_dir(repo_root()),
        &format!("`cargo {args}`"),
    )
}
