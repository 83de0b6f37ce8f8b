//! `kiln`: the command line of the kiln inference engine.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "A Llama-family inference engine with an ahead-of-time compiled OpenXLA/IREE path"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report the IREE runtime this binary was built with, the compiler, and the devices found.
    Inspect,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect => inspect::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "xla-iree")]
mod inspect {
    use anyhow::Result;
    use kiln_iree::Instance;
    use kiln_xla::Compiler;

    pub fn run() -> Result<()> {
        println!("IREE runtime revision: {}", kiln_iree::RUNTIME_REVISION);
        println!("IREE prefix drivers:   {}", kiln_iree::PREFIX_HAL_DRIVERS);
        match Compiler::from_env() {
            Ok(compiler) => println!(
                "iree-compile:          {} ({})",
                compiler.version_line(),
                compiler.path().display()
            ),
            Err(error) => println!("iree-compile:          unavailable: {error}"),
        }
        let instance = Instance::new()?;
        for driver in instance.drivers()? {
            match instance.device(&driver) {
                Ok(_) => println!("device {driver:<12} available"),
                Err(error) => println!("device {driver:<12} unavailable: {error}"),
            }
        }
        Ok(())
    }
}

#[cfg(not(feature = "xla-iree"))]
mod inspect {
    use anyhow::Result;

    pub fn run() -> Result<()> {
        println!("IREE backend: not compiled in (build with --features xla-iree or cuda,xla-iree)");
        Ok(())
    }
}
