//! `cargo xtask`: kiln's build tasks for machines without Nix. They read the
//! same pin file as the flake (`nix/pins.json`) and produce the same IREE
//! prefix layout.

mod cache;
mod compiler;
mod disk;
mod emulated;
mod env;
mod fetch;
mod gate;
mod iree;
mod iree_patches;
mod kernels;
mod nix;
mod pins;
mod prefix;
mod process;
mod ptxas;
mod reference_files;
mod repro;
#[cfg(test)]
mod rerun;
mod setup;
#[cfg(test)]
mod setup_coverage;
mod steps;
mod target;
mod test;
mod tools;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::cache::Cache;
use crate::iree::Variant;
use crate::pins::Pins;
use crate::target::Target;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "kiln's build tasks (the portable twin of the Nix flake; docs/development.md)"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build the IREE runtime from the pinned source into a cached prefix.
    Iree {
        /// Include the CUDA HAL driver (built against the pinned CUDA 12.9 headers).
        #[arg(long)]
        cuda: bool,
        /// Cross-compile for this Rust target triple (aarch64-unknown-linux-gnu:
        /// Debian's cross toolchain) instead of building for this machine.
        #[arg(long)]
        target: Option<String>,
    },
    /// Install the pinned iree-compile from its wheel and check its revision.
    Compiler,
    /// Print shell exports for `eval "$(cargo xtask env)"` (CUDA prefix unless --cpu).
    Env {
        /// Point at the CPU-only prefix instead of the CUDA-enabled one.
        #[arg(long)]
        cpu: bool,
        /// The prefix built for this Rust target triple (default: this machine's).
        #[arg(long)]
        target: Option<String>,
    },
    /// Download every pinned input, for every system, and check its sha256.
    VerifyPins,
    /// Fetch and unpack the pinned reference files (released vocabularies and
    /// chat templates); print their folder, for `KILN_REFERENCE_FILES`.
    ReferenceFiles,
    /// Install what the suite and nix-build need: system packages (apt, as
    /// root or with sudo), the pinned Nix linters (and cargo-nextest where
    /// none is on PATH), the hash-pinned Python tools.
    Setup,
    /// Set up (as `setup`), then run the whole test suite: lint, both IREE
    /// variants, the tests, the gate.
    Test(test::Plan),
    /// The link gate: link every release cuda,xla-iree target, then prove with
    /// the mutation suite that link-only regressions fail it.
    Gate {
        /// Link for this Rust target triple (aarch64-unknown-linux-gnu: with
        /// Debian's cross toolchain, against `cargo xtask iree --cuda --target …`).
        #[arg(long)]
        target: Option<String>,
        #[command(flatten)]
        options: gate::Options,
    },
    /// Run another architecture's kiln-core and kiln-cpu tests and
    /// xla_prepared_prefill (local-task) under qemu, from the executables the
    /// gate's link check built for it (linked first if not current).
    EmulatedTests {
        /// The cross target (default: aarch64-unknown-linux-gnu, the GB10's).
        #[arg(long, default_value = target::AARCH64)]
        target: String,
    },
    /// Check every Nix file: parse, nixpkgs-fmt, deadnix.
    LintNix,
    /// Evaluate every flake output for every system and instantiate every
    /// derivation with this machine's Nix; write nix/eval/summary.json.
    EvalNix {
        /// A folder with nixpkgs-lib/ (holding nixpkgs' lib/), crane/ and
        /// rust-overlay/ at flake.lock's revisions (default: downloaded from
        /// GitHub by flake.lock).
        #[arg(long)]
        inputs: Option<PathBuf>,
        /// Only check that the committed summary is current (no Nix needed).
        #[arg(long)]
        check: bool,
    },
    /// Build the flake's packages and checks for this system with this
    /// machine's Nix, against kiln's host-backed package set
    /// (nix/build/host-nixpkgs.nix); the machine's /nix/store is kept.
    NixBuild(nix::BuildOptions),
    /// Compile kiln's own CUDA kernels (crates/kiln-xla/kernels/*.cu) to the
    /// PTX committed beside them, with Debian 12's clang-14.
    Kernels {
        /// Fail where the committed PTX differs from what its source
        /// compiles to, instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Assemble the PTX of every module kiln prepares (embedded model and
    /// TinyLlama's shape, f32 and f16) with the pinned CUDA's ptxas for each
    /// pinned capability; report registers, spills and shared memory per kernel.
    Ptxas(ptxas::Args),
    /// Check the GitHub workflows' security invariants; lint them with
    /// actionlint (shellcheck, pyflakes) and zizmor.
    LintWorkflows,
    /// Build the release cuda,xla-iree binaries twice (two checkout paths, two
    /// target folders) and compare them.
    Repro,
    /// Install a prefix from a finished build of nix/iree-prefix (used by the Nix derivation).
    #[command(hide = true)]
    IreePrefixInstall(prefix::InstallArgs),
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.task {
        Task::Iree { cuda, target } => {
            let variant = if cuda { Variant::Cuda } else { Variant::Cpu };
            let target = Target::parse(target.as_deref())?;
            let prefix = iree::build(&Cache::open()?, &Pins::of_checkout()?, variant, &target)?;
            println!("{}", prefix.display());
        }
        Task::Compiler => {
            let (binary, version) = compiler::install(&Cache::open()?, &Pins::of_checkout()?)?;
            eprintln!("{version} (matches the pin)");
            println!("{}", binary.display());
        }
        Task::Env { cpu, target } => {
            let variant = if cpu { Variant::Cpu } else { Variant::Cuda };
            let target = Target::parse(target.as_deref())?;
            print!(
                "{}",
                env::exports(&Cache::open()?, &Pins::of_checkout()?, variant, &target)?
            );
        }
        Task::VerifyPins => fetch::verify_pins(&Cache::open()?, &Pins::of_checkout()?)?,
        Task::ReferenceFiles => {
            let folder = reference_files::provide(&Cache::open()?, &Pins::of_checkout()?)?;
            println!("{}", folder.display());
        }
        Task::Setup => {
            setup::run(&Cache::open()?, setup::Scope::Everything)?;
        }
        Task::Test(plan) => test::run(&Cache::open()?, &Pins::of_checkout()?, &plan)?,
        Task::Gate { target, options } => {
            let target = Target::parse(target.as_deref())?;
            gate::run(&iree::gate_prefix(&target)?, &target, &options)?;
        }
        Task::EmulatedTests { target } => {
            let target = Target::parse(Some(&target))?;
            let prefix = iree::gate_prefix(&target)?;
            let (compiler, _) = compiler::install(&Cache::open()?, &Pins::of_checkout()?)?;
            emulated::run(&prefix, &compiler, &target)?;
        }
        Task::Repro => repro::run(&iree::gate_prefix(&Target::host()?)?)?,
        Task::LintNix => nix::lint(&setup::Toolbox::installed(&Cache::open()?)?)?,
        Task::Kernels { check } => kernels::run(check)?,
        Task::LintWorkflows => {
            let tools = setup::Toolbox::installed(&Cache::open()?)?;
            workflow_lint::run(&pins::repo_root(), &|program, purpose| {
                tools.find(program, purpose)
            })?
        }
        Task::EvalNix { check: true, .. } => nix::eval_check()?,
        Task::EvalNix { inputs, .. } => nix::eval(&Cache::open()?, inputs.as_deref())?,
        Task::NixBuild(options) => nix::build(&Cache::open()?, options)?,
        Task::Ptxas(args) => ptxas::run(args)?,
        Task::IreePrefixInstall(args) => prefix::install_from(args)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mutations check's phase `name`, as evaluated into the committed
    /// summary; `None` in the Nix tests' source, which leaves the summary out
    /// (crates/nix-harness/tests/flake.rs holds the flake's other promises).
    fn mutations_phase(name: &str) -> Option<String> {
        let path = crate::pins::repo_root().join("nix/eval/summary.json");
        let Ok(text) = std::fs::read_to_string(path) else {
            println!("skipped: nix/eval/summary.json is not in this source tree");
            return None;
        };
        let summary: serde_json::Value = serde_json::from_str(&text).unwrap();
        let phase = &summary["systems"]["x86_64-linux"]["checks.mutations"]["env"][name];
        Some(phase.as_str().expect("the mutations check's phase").into())
    }

    /// The `mutations` check must find the gate's report where the gate writes
    /// it. It used to copy `target/gate/report.json`, a name the gate never
    /// wrote (`report-TRIPLE.json`), so the check failed after a green gate.
    /// Now the gate writes into `$out` itself: its command line must be one
    /// xtask accepts, with `--out $out`, and nothing else may name the report.
    #[test]
    fn the_nix_mutations_check_has_the_gate_write_its_report_into_out() {
        let Some(build) = mutations_phase("buildPhase") else {
            return;
        };
        let line = build
            .lines()
            .find(|l| l.contains("--package xtask -- gate"))
            .unwrap_or_else(|| panic!("the mutations check runs no gate:\n{build}"));
        let args = line.split(" -- ").nth(1).unwrap().split_whitespace();
        let cli = Cli::try_parse_from(std::iter::once("xtask").chain(args))
            .unwrap_or_else(|e| panic!("xtask refuses the Nix check's gate command `{line}`: {e}"));
        match cli.task {
            Task::Gate { options, .. } => assert_eq!(options.out, Some(PathBuf::from("$out"))),
            _ => panic!("`{line}` is not the gate"),
        }
        let install = mutations_phase("installPhase").unwrap();
        assert!(
            !install.contains("target/gate"),
            "the install phase guesses the gate's report name:\n{install}"
        );
    }
}
