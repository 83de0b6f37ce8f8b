//! `cargo xtask`: kiln's build tasks for machines without Nix. They read the
//! same pin file as the flake (`nix/pins.json`) and produce the same IREE
//! prefix layout.

mod cache;
mod compiler;
mod digest;
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
mod tree;
mod unpack;
mod verify_pins;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::cache::Cache;
use crate::iree::Variant;
use crate::pins::{Pins, default_pin_file};
use crate::target::Target;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "kiln's build tasks (the portable twin of the Nix flake)"
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
    /// chat templates the tests hold kiln to); print their folder, for
    /// `KILN_REFERENCE_FILES`.
    ReferenceFiles,
    /// Install what the suite and nix-build need: the system packages (apt,
    /// as root or with sudo), nixpkgs-fmt and deadnix (cargo-nextest where
    /// none is on PATH), the hash-pinned workflow linters.
    Setup,
    /// Set up (as `setup`), then run the whole test suite: lint, both IREE
    /// variants, the tests, the gate.
    Test {
        /// Leave out the GB10's architecture: the cross-built aarch64 prefix,
        /// the aarch64 gate and the aarch64 tests under qemu (about 20
        /// minutes of a cold run on 2 cores). CI runs them; this is for a
        /// quicker local run.
        #[arg(long)]
        skip_aarch64: bool,
        /// The developer loop (about 10 minutes warm): rustfmt, clippy, the
        /// CPU tests and the link check, nothing else.
        #[arg(long)]
        quick: bool,
        /// Defer (loudly; never reported as passed) the expensive steps that
        /// would end the run past this many minutes: ptxas, the aarch64
        /// steps, repro. CI gives 80.
        #[arg(long)]
        budget_minutes: Option<u64>,
    },
    /// The link gate: link every release cuda,xla-iree target, then prove with
    /// the mutation suite that link-only regressions fail it.
    Gate {
        /// Only the link check, no mutation suite.
        #[arg(long)]
        link_only: bool,
        /// Run only the named mutation.
        #[arg(long)]
        mutation: Option<String>,
        /// Link for this Rust target triple (aarch64-unknown-linux-gnu: with
        /// Debian's cross toolchain, against `cargo xtask iree --cuda --target …`).
        #[arg(long)]
        target: Option<String>,
        /// Also write the report (report-TRIPLE.json) into this folder, made
        /// if absent: the Nix check's `$out`.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Run another architecture's kiln-core and kiln-cpu tests and xla_prepared_prefill
    /// (local-task) under qemu: the executables the gate's link check built
    /// for it (the link check runs first if they are not current).
    EmulatedTests {
        /// The cross target (default: aarch64-unknown-linux-gnu, the GB10's).
        #[arg(long, default_value = target::AARCH64)]
        target: String,
    },
    /// Check every Nix file: parse, nixpkgs-fmt, deadnix.
    LintNix,
    /// Evaluate every flake output for every system and instantiate every
    /// derivation with this machine's Nix (real nixpkgs lib, crane and
    /// rust-overlay, a stand-in for nixpkgs' packages); write
    /// nix/eval/summary.json.
    EvalNix {
        /// A folder with nixpkgs-lib/ (holding nixpkgs' lib/), crane/ and
        /// rust-overlay/ at flake.lock's revisions; without it they are
        /// downloaded from GitHub by flake.lock.
        #[arg(long)]
        inputs: Option<PathBuf>,
        /// Only check that the committed summary is current (no Nix needed).
        #[arg(long)]
        check: bool,
    },
    /// Build the flake's packages and checks for this system with this
    /// machine's Nix (nix-bin), against kiln's host-backed package set
    /// (nix/build/host-nixpkgs.nix); the machine's /nix/store is kept.
    NixBuild {
        /// As for eval-nix: nixpkgs-lib/, crane/, rust-overlay/ at
        /// flake.lock's revisions (default: downloaded from GitHub).
        #[arg(long)]
        inputs: Option<PathBuf>,
        /// Build in Nix's sandbox (nixbld users; the host's tool folders
        /// visible read-only, no network but for fixed-output downloads).
        #[arg(long)]
        sandbox: bool,
        /// Enter the contributor's shell (devShells.default) with
        /// nix-shell, after building its inputs, and run this command in it
        /// from the checkout (e.g. "cargo build --release --features
        /// cuda,xla-iree && cargo xtask test --quick"); the shell is pure:
        /// only what it provides is on PATH.
        #[arg(long, value_name = "COMMAND", conflicts_with_all = ["attributes", "sandbox"])]
        shell: Option<String>,
        /// Outputs to build, e.g. checks.link (default: every package and
        /// check).
        attributes: Vec<String>,
    },
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
    Ptxas {
        /// kiln-bench-decode built with cuda,xla-iree (default: built here).
        #[arg(long)]
        bench: Option<PathBuf>,
        /// iree-compile (default: the pinned one, installed here).
        #[arg(long)]
        compiler: Option<PathBuf>,
        /// ptxas (default: the pinned nvcc wheel's).
        #[arg(long)]
        ptxas: Option<PathBuf>,
        /// The folder of kiln's own kernels and their PTX (default: this
        /// checkout's crates/kiln-xla/kernels).
        #[arg(long)]
        kernels: Option<PathBuf>,
        /// The pin file (default: this checkout's).
        #[arg(long)]
        pins: Option<PathBuf>,
        /// Where report.json goes (default: target/ptxas).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check the GitHub workflows' security invariants; lint them with
    /// actionlint (shellcheck, pyflakes) and zizmor.
    LintWorkflows,
    /// Build the release cuda,xla-iree binaries twice (two checkout paths, two
    /// target folders) and compare them.
    Repro,
    /// Install a prefix from a finished build of nix/iree-prefix (used by the Nix derivation).
    #[command(hide = true)]
    IreePrefixInstall {
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
    },
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
            let prefix = iree::build(&Cache::open()?, &load_pins()?, variant, &target)?;
            println!("{}", prefix.display());
        }
        Task::Compiler => {
            let (binary, version) = compiler::install(&Cache::open()?, &load_pins()?)?;
            eprintln!("{version} (matches the pin)");
            println!("{}", binary.display());
        }
        Task::Env { cpu, target } => {
            let variant = if cpu { Variant::Cpu } else { Variant::Cuda };
            let target = Target::parse(target.as_deref())?;
            print!(
                "{}",
                env::exports(&Cache::open()?, &load_pins()?, variant, &target)?
            );
        }
        Task::VerifyPins => verify_pins::run(&Cache::open()?, &load_pins()?)?,
        Task::ReferenceFiles => {
            let folder = reference_files::provide(&Cache::open()?, &load_pins()?)?;
            println!("{}", folder.display());
        }
        Task::Setup => {
            setup::run(&Cache::open()?, setup::Scope::Everything)?;
        }
        Task::Test {
            skip_aarch64,
            quick,
            budget_minutes,
        } => {
            let plan = test::Plan {
                with_aarch64: !skip_aarch64,
                quick,
                budget: budget_minutes.map(|m| std::time::Duration::from_secs(m * 60)),
            };
            test::run(&Cache::open()?, &load_pins()?, &plan)?
        }
        Task::Gate {
            link_only,
            mutation,
            target,
            out,
        } => {
            let target = Target::parse(target.as_deref())?;
            let prefix = prefix_for_gate(&target)?;
            let options = gate::Options {
                link_only,
                only: mutation.as_deref(),
                out: out.as_deref(),
            };
            gate::run(&prefix, &target, &options)?;
        }
        Task::EmulatedTests { target } => {
            let target = Target::parse(Some(&target))?;
            let prefix = prefix_for_gate(&target)?;
            let (compiler, _) = compiler::install(&Cache::open()?, &load_pins()?)?;
            emulated::run(&prefix, &compiler, &target)?;
        }
        Task::Repro => repro::run(&prefix_for_gate(&Target::host()?)?)?,
        Task::LintNix => nix::lint(&setup::Toolbox::installed(&Cache::open()?)?)?,
        Task::Kernels { check } => kernels::run(check)?,
        Task::LintWorkflows => {
            let tools = setup::Toolbox::installed(&Cache::open()?)?;
            workflow_lint::run(&pins::repo_root(), &|program, purpose| {
                tools.find(program, purpose)
            })?
        }
        Task::EvalNix { inputs, check } => {
            if check {
                nix::eval_check()?;
            } else {
                nix::eval(&Cache::open()?, inputs.as_deref())?;
            }
        }
        Task::NixBuild {
            inputs,
            sandbox,
            shell,
            attributes,
        } => nix::build(
            &Cache::open()?,
            nix::BuildOptions {
                inputs: inputs.as_deref(),
                sandbox,
                shell,
                attributes,
            },
        )?,
        Task::Ptxas {
            bench,
            compiler,
            ptxas,
            kernels,
            pins,
            out,
        } => {
            let pins = Pins::load(&pins.unwrap_or_else(default_pin_file))?;
            let tools = ptxas::Tools {
                bench: match bench {
                    Some(path) => path,
                    None => ptxas::build_bench(&prefix_for_gate(&Target::host()?)?)?,
                },
                compiler: match compiler {
                    Some(path) => path,
                    None => compiler::install(&Cache::open()?, &pins)?.0,
                },
                ptxas: match ptxas {
                    Some(path) => path,
                    None => ptxas::pinned_ptxas(&Cache::open()?, &pins)?,
                },
                kernels: kernels.unwrap_or_else(kernels::folder),
            };
            let out = out.unwrap_or_else(|| crate::pins::repo_root().join("target/ptxas"));
            ptxas::run(&tools, &pins.cuda.capabilities, &out)?;
        }
        Task::IreePrefixInstall {
            build,
            source,
            out,
            pins,
            target,
        } => {
            let pins = Pins::load(&pins.unwrap_or_else(default_pin_file))?;
            let target = Target::parse(target.as_deref())?;
            let id = prefix::Identity {
                version: &pins.iree.version,
                revision: &pins.iree.revision,
                target: target.triple,
            };
            prefix::install(&build, &source, &out, &id)?;
        }
    }
    Ok(())
}

/// The CUDA prefix the gate links against: for the host, `KILN_IREE_PREFIX`
/// when the environment provides one (`nix develop`, the flake's checks);
/// otherwise the one `cargo xtask iree --cuda [--target T]` builds for the
/// current pins (an environment's prefix is the host's, never a cross one).
fn prefix_for_gate(target: &Target) -> Result<PathBuf> {
    match std::env::var_os("KILN_IREE_PREFIX") {
        Some(prefix) if !prefix.is_empty() && !target.cross => Ok(PathBuf::from(prefix)),
        _ => iree::build(&Cache::open()?, &load_pins()?, Variant::Cuda, target),
    }
}

fn load_pins() -> Result<Pins> {
    Pins::load(&default_pin_file())
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
        Some(
            phase
                .as_str()
                .expect("the mutations check's phase")
                .to_string(),
        )
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
            Task::Gate { out, .. } => assert_eq!(out, Some(PathBuf::from("$out"))),
            _ => panic!("`{line}` is not the gate"),
        }
        let install = mutations_phase("installPhase").unwrap();
        assert!(
            !install.contains("target/gate"),
            "the install phase guesses the gate's report name:\n{install}"
        );
    }
}
